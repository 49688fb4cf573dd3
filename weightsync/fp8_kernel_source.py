"""The CUDA C++ source of the block FP8 kernel, compiled by :mod:`.copy_kernel` with the copy
kernels and launched by :mod:`.fp8_kernel`.

``quantize_fp8``: a CUDA block per 128 x 128 tile of a bf16 weight reads the tile once, takes
its largest magnitude and writes the tile's e4m3 values and its float32 scale, with the
arithmetic torch uses on CUDA for :func:`.fp8.quantize_block_fp8` (so the bytes are equal).
The tests compile this same source for the CPU (``tests/support/cuda_on_cpu.py``).
"""

SOURCE = r"""
// torch's float -> float8_e4m3fn (c10's fp8e4m3fn_from_fp32_value, on host and device alike):
// round to nearest even; 464 and up (the halfway point past 448) become NaN; values under
// e4m3's smallest normal are rounded by a float addition, as c10 does.
__device__ __forceinline__ unsigned to_e4m3(float f) {
    unsigned bits = __float_as_uint(f);
    const unsigned sign = bits & 0x80000000u;
    bits ^= sign;
    unsigned out;
    if (bits >= (1087u << 20)) {
        out = 0x7fu;
    } else if (bits < (121u << 23)) {
        const unsigned denorm = 141u << 23;
        out = __float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(denorm))) - denorm;
    } else {
        bits += ((unsigned)(7 - 127) << 23) + 0x7ffffu + ((bits >> 20) & 1u);
        out = bits >> 20;
    }
    return (out | (sign >> 24)) & 0xffu;
}

// fp8._ceil_to_power_of_two: the exponent bumped by a nonzero mantissa, kept normal.
__device__ __forceinline__ float ceil_power_of_two(float scale) {
    const unsigned bits = __float_as_uint(scale) & 0x7fffffffu;
    unsigned e = ((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u);
    e = e < 1u ? 1u : (e > 254u ? 254u : e);
    return __uint_as_float(e << 23);
}

__device__ __forceinline__ unsigned bf16_magnitude(unsigned word, unsigned most) {
    const unsigned lo = word & 0x7fffu, hi = (word >> 16) & 0x7fffu;
    most = lo > most ? lo : most;
    return hi > most ? hi : most;
}

// Two floats as two e4m3 bytes, ``lo`` in the low one. Hopper and Ada convert in one
// instruction, rounding as to_e4m3 does; they saturate at 448 where to_e4m3 gives NaN, which
// no product here reaches (each is at most the block's amax times its scale's reciprocal).
__device__ __forceinline__ unsigned to_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    return pair;
#else
    return to_e4m3(lo) | (to_e4m3(hi) << 8);
#endif
}

// Eight bf16 (one 16-byte load) as eight e4m3 bytes, in order.
__device__ __forceinline__ unsigned long long quantize8(const uint4& v, float inv) {
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
    unsigned long long out = 0;
    for (int i = 0; i < 4; ++i) {
        const float lo = __fmul_rn(__uint_as_float(words[i] << 16), inv);
        const float hi = __fmul_rn(__uint_as_float(words[i] & 0xffff0000u), inv);
        out |= (unsigned long long)to_e4m3x2(lo, hi) << (16 * i);
    }
    return out;
}

// A table row per tensor, ascending by first tile: (source, source pitch, rows, columns,
// values, values pitch, scales, first tile); pitches in bytes. Blocks of 256 threads. A whole
// tile whose rows are 16-byte aligned (8-byte for its values) is held in registers, 8 loads
// of 16 bytes per thread; an edge tile goes an element at a time.
extern "C" __global__ void __launch_bounds__(256) quantize_fp8(
        const unsigned long long* table, unsigned long long tensors, unsigned long long ue8m0) {
    unsigned long long lo = 0, hi = tensors;
    while (hi - lo > 1ull) {
        const unsigned long long mid = (lo + hi) >> 1;
        if (table[8ull * mid + 7ull] <= blockIdx.x) lo = mid;
        else hi = mid;
    }
    const unsigned long long* row = table + 8ull * lo;
    const unsigned long long sp = row[1], rows = row[2], cols = row[3], dp = row[5];
    const unsigned long long tile = blockIdx.x - row[7], across = (cols + 127ull) >> 7;
    const unsigned long long r0 = (tile / across) << 7, c0 = (tile % across) << 7;
    const unsigned h = (unsigned)(rows - r0 < 128ull ? rows - r0 : 128ull);
    const unsigned w = (unsigned)(cols - c0 < 128ull ? cols - c0 : 128ull);
    const char* src = (const char*)row[0] + r0 * sp + 2ull * c0;
    unsigned char* dst = (unsigned char*)row[4] + r0 * dp + c0;
    const bool whole = h == 128u && w == 128u && !(((unsigned long long)src | sp) & 15ull) &&
                       !(((unsigned long long)dst | dp) & 7ull);
    uint4 v[8];
    unsigned most = 0;
    if (whole) {
        for (int k = 0; k < 8; ++k) {
            const unsigned u = threadIdx.x + 256u * k;
            v[k] = *(const uint4*)(src + (u >> 4) * sp + (u & 15u) * 16u);
        }
        for (int k = 0; k < 8; ++k) {
            most = bf16_magnitude(v[k].x, most);
            most = bf16_magnitude(v[k].y, most);
            most = bf16_magnitude(v[k].z, most);
            most = bf16_magnitude(v[k].w, most);
        }
    } else {
        for (unsigned u = threadIdx.x; u < h * w; u += 256u) {
            const unsigned r = u / w, c = u - r * w;
            most = bf16_magnitude(((const unsigned short*)(src + r * sp))[c], most);
        }
    }
    // The tile's largest magnitude, as bits: for non-negative floats their order is the
    // bits' order (a NaN, above infinity, wins, as it does in torch's amax).
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned other = (unsigned)__shfl_down_sync(0xffffffffu, (unsigned long long)most, o);
        most = other > most ? other : most;
    }
    __shared__ unsigned warps[8];
    if ((threadIdx.x & 31u) == 0u) warps[threadIdx.x >> 5] = most;
    __syncthreads();
    for (int k = 0; k < 8; ++k) most = warps[k] > most ? warps[k] : most;
    float amax = __uint_as_float(most << 16);
    const float floor = (float)1e-4;  // torch's clamp: the double 1e-4 as a float
    amax = amax < floor ? floor : amax;
    // torch on CUDA divides a tensor by a number as a product with the number's reciprocal.
    float scale = __fmul_rn(amax, 1.0f / 448.0f);
    if (ue8m0) scale = ceil_power_of_two(scale);
    const float inv = __fdiv_rn(1.0f, scale);
    if (whole) {
        for (int k = 0; k < 8; ++k) {
            const unsigned u = threadIdx.x + 256u * k;
            *(unsigned long long*)(dst + (u >> 4) * dp + (u & 15u) * 8u) = quantize8(v[k], inv);
        }
    } else {
        for (unsigned u = threadIdx.x; u < h * w; u += 256u) {
            const unsigned r = u / w, c = u - r * w;
            const unsigned x = ((const unsigned short*)(src + r * sp))[c];
            dst[r * dp + c] = (unsigned char)to_e4m3(__fmul_rn(__uint_as_float(x << 16), inv));
        }
    }
    if (threadIdx.x == 0u) ((float*)row[6])[tile] = scale;
}
"""
