"""The CUDA C++ source of the copy kernels, compiled by :mod:`.copy_kernel` at first use.

``copy_chunks``: a table row per block, each a contiguous chunk or a box of strided rows, copied
in the widest aligned units. ``copy_sum``: the same copies taking the bucket checksum on the way
(each 8-byte word weighted by its checksum row position, :mod:`.checksum`), or summing only.
``copy_sum_also``: ``copy_sum`` whose rows name a second destination, written with the same
values (the sender packing a bucket and writing it into a receiver's weights in one read).
The tests compile this same source for the CPU (``tests/support/cuda_on_cpu.py``).
"""

SOURCE = r"""
// A table row per block: (source, destination, bytes per row, rows, source pitch, destination
// pitch). One row: a contiguous chunk, 16 bytes per load where both ends are 16-byte aligned,
// four loads in flight per thread. Several: a box of strided rows (a column shard), in the
// widest units that every address, the row length and both pitches are multiples of.
// A thread's place in a box (row r, unit c) moves on by the block's width without dividing,
// and four loads are in flight per thread, as in a contiguous chunk: with a division and one
// load per unit, a TP=2 trainer's row-parallel shards made the 7B copy 0.3 ms slower on H200.
struct Place {
    unsigned r, c;
};

__device__ __forceinline__ Place advance(Place p, unsigned dr, unsigned dc, unsigned units) {
    p.c += dc;
    p.r += dr;
    if (p.c >= units) {
        p.c -= units;
        ++p.r;
    }
    return p;
}

template <class T>
__device__ __forceinline__ void copy_rows(const char* src, char* dst, unsigned long long width,
        unsigned long long rows, unsigned long long sp, unsigned long long dp) {
    const unsigned units = (unsigned)(width / sizeof(T)), total = units * (unsigned)rows;
    const unsigned step = blockDim.x, dr = step / units, dc = step % units;
    Place p = {threadIdx.x / units, threadIdx.x % units};
#define AT(base, pitch, q) (((T*)((base) + (q).r * (pitch)))[(q).c])
    unsigned u = threadIdx.x;
    for (; u + 3 * step < total; u += 4 * step) {
        const Place p1 = advance(p, dr, dc, units), p2 = advance(p1, dr, dc, units),
                    p3 = advance(p2, dr, dc, units);
        const T a = AT(src, sp, p), b = AT(src, sp, p1), c = AT(src, sp, p2), e = AT(src, sp, p3);
        AT(dst, dp, p) = a;
        AT(dst, dp, p1) = b;
        AT(dst, dp, p2) = c;
        AT(dst, dp, p3) = e;
        p = advance(p3, dr, dc, units);
    }
    for (; u < total; u += step) {
        AT(dst, dp, p) = AT(src, sp, p);
        p = advance(p, dr, dc, units);
    }
#undef AT
}

extern "C" __global__ void __launch_bounds__(1024) copy_chunks(const unsigned long long* table) {
    const unsigned long long* row = table + 6ull * blockIdx.x;
    const char* src = (const char*)row[0];
    char* dst = (char*)row[1];
    const unsigned long long n = row[2], rows = row[3];
    if (rows > 1) {
        const unsigned long long sp = row[4], dp = row[5];
        const unsigned long long all =
            (unsigned long long)src | (unsigned long long)dst | n | sp | dp;
        if (!(all & 15ull)) copy_rows<uint4>(src, dst, n, rows, sp, dp);
        else if (!(all & 7ull)) copy_rows<unsigned long long>(src, dst, n, rows, sp, dp);
        else if (!(all & 3ull)) copy_rows<unsigned int>(src, dst, n, rows, sp, dp);
        else if (!(all & 1ull)) copy_rows<unsigned short>(src, dst, n, rows, sp, dp);
        else copy_rows<unsigned char>(src, dst, n, rows, sp, dp);
        return;
    }
    unsigned long long done = 0;
    if ((((unsigned long long)src | (unsigned long long)dst) & 15ull) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        const unsigned long long n16 = n >> 4, step = blockDim.x;
        unsigned long long i = threadIdx.x;
        for (; i + 3 * step < n16; i += 4 * step) {  // four loads in flight per thread
            const uint4 a = s[i], b = s[i + step], c = s[i + 2 * step], e = s[i + 3 * step];
            d[i] = a;
            d[i + step] = b;
            d[i + 2 * step] = c;
            d[i + 3 * step] = e;
        }
        for (; i < n16; i += step) d[i] = s[i];
        done = n16 << 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// One table row per block: (source, destination, bytes per row, rows, source pitch,
// destination pitch, first word, flags). ``word`` is the bucket word index of the summed side's
// first byte (8-byte aligned, as are both ends); flags: 1 sum the destination (else the
// source: which pitch is the bucket's), 2 copy without summing, and destination 0 sums the
// source without copying (landed bytes: the source pitch theirs, flag 1 the bucket's). A word's
// weight is its checksum row position (checksum.py): rows of 8192 words up to ``whole``, then
// rows of 32. One row: a span; a tail shorter than a word is summed as the whole word of the
// summed side, read after the copy (the rest of it is padding nobody writes). Several rows: a
// box (a TP shard's columns), every address, length and pitch a multiple of 8.
__device__ __forceinline__ unsigned long long row_position(
        unsigned long long w, unsigned long long whole) {
    return w < whole ? (w >> 13) + 1ull : (whole >> 13) + ((w - whole) >> 5) + 1ull;
}

__device__ __forceinline__ void take(const uint4& v, unsigned long long w,
        unsigned long long whole, unsigned long long& a, unsigned long long& b) {
    const unsigned long long lo = ((unsigned long long)v.y << 32) | v.x;
    const unsigned long long hi = ((unsigned long long)v.w << 32) | v.z;
    a += lo * row_position(w, whole) + hi * row_position(w + 1ull, whole);
    b += lo + hi;
}

__device__ __forceinline__ void take(unsigned long long v, unsigned long long w,
        unsigned long long whole, unsigned long long& a, unsigned long long& b) {
    a += v * row_position(w, whole);
    b += v;
}

// The block's two sums, added to ``out`` once per block.
__device__ __forceinline__ void reduce(
        unsigned long long a, unsigned long long b, unsigned long long* out) {
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, o);
        b += __shfl_down_sync(0xffffffffu, b, o);
    }
    __shared__ unsigned long long part[2][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { part[0][warp] = a; part[1][warp] = b; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); ++k) { a += part[0][k]; b += part[1][k]; }
        atomicAdd(out, a);
        atomicAdd(out + 1, b);
    }
}

// ``also`` (0: none) takes every byte written to ``dst``, at the same offsets and pitch.
template <class T>
__device__ __forceinline__ void sum_rows(const char* src, char* dst, char* also,
        unsigned long long width, unsigned long long rows, unsigned long long sp,
        unsigned long long dp, unsigned long long pitch_words, unsigned long long first,
        unsigned long long whole, unsigned long long& a, unsigned long long& b) {
    const unsigned units = (unsigned)(width / sizeof(T)), total = units * (unsigned)rows;
    for (unsigned u = threadIdx.x; u < total; u += blockDim.x) {
        const unsigned r = u / units, c = u - r * units;
        const T v = ((const T*)(src + r * sp))[c];
        if (dst) ((T*)(dst + r * dp))[c] = v;
        if (also) ((T*)(also + r * dp))[c] = v;
        take(v, first + r * pitch_words + c * (sizeof(T) / 8), whole, a, b);
    }
}

// ``copy_sum``'s row (COLUMNS 8) or ``copy_sum_also``'s (9: the ninth the second destination,
// which must be aligned as the first is).
template <int COLUMNS>
__device__ __forceinline__ void copy_sum_row(
        const unsigned long long* table, unsigned long long whole, unsigned long long* out) {
    const unsigned long long* row = table + (unsigned long long)COLUMNS * blockIdx.x;
    const char* src = (const char*)row[0];
    char* dst = (char*)row[1];
    char* also = COLUMNS > 8 ? (char*)row[COLUMNS - 1] : nullptr;
    const unsigned long long n = row[2], rows = row[3], first = row[6], flags = row[7];
    const bool copy = dst != 0, sum = !(flags & 2ull);
    unsigned long long a = 0, b = 0;
    if (rows > 1) {
        const unsigned long long sp = row[4], dp = row[5];
        const unsigned long long pitch_words = (flags & 1ull ? dp : sp) >> 3;
        const unsigned long long all =
            (unsigned long long)src | (unsigned long long)dst | (unsigned long long)also | n |
            sp | dp;
        if (!(all & 15ull))
            sum_rows<uint4>(src, dst, also, n, rows, sp, dp, pitch_words, first, whole, a, b);
        else
            sum_rows<unsigned long long>(
                src, dst, also, n, rows, sp, dp, pitch_words, first, whole, a, b);
        if (sum) reduce(a, b, out);
        return;
    }
    const unsigned long long n8 = n >> 3, step = blockDim.x;
    unsigned long long i = threadIdx.x;
    if ((((unsigned long long)src | (unsigned long long)dst | (unsigned long long)also) & 15ull)
            == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        uint4* d2 = (uint4*)also;
        const unsigned long long n16 = n8 >> 1;
        for (; i + 3 * step < n16; i += 4 * step) {  // four loads in flight per thread
            uint4 v[4];
            for (int k = 0; k < 4; ++k) v[k] = s[i + k * step];
            for (int k = 0; k < 4; ++k) {
                if (copy) d[i + k * step] = v[k];
                if (also) d2[i + k * step] = v[k];
                take(v[k], first + 2ull * (i + k * step), whole, a, b);
            }
        }
        for (; i < n16; i += step) {
            const uint4 v = s[i];
            if (copy) d[i] = v;
            if (also) d2[i] = v;
            take(v, first + 2ull * i, whole, a, b);
        }
        i = (n16 << 1) + threadIdx.x;
    }
    const unsigned long long* s8 = (const unsigned long long*)src;
    unsigned long long* d8 = (unsigned long long*)dst;
    unsigned long long* a8 = (unsigned long long*)also;
    for (; i < n8; i += step) {
        const unsigned long long v = s8[i];
        if (copy) d8[i] = v;
        if (also) a8[i] = v;
        take(v, first + i, whole, a, b);
    }
    const unsigned long long tail = n8 << 3;
    if (copy) for (unsigned long long j = tail + threadIdx.x; j < n; j += step) dst[j] = src[j];
    if (also) for (unsigned long long j = tail + threadIdx.x; j < n; j += step) also[j] = src[j];
    if (!sum) return;
    if (n > tail) {
        __syncthreads();  // the tail's bytes written before the word holding them is read
        if (threadIdx.x == 0) {
            const unsigned long long v = *(const unsigned long long*)(
                (flags & 1ull ? (const char*)dst : src) + tail);
            take(v, first + n8, whole, a, b);
        }
    }
    reduce(a, b, out);
}

extern "C" __global__ void __launch_bounds__(1024) copy_sum(
        const unsigned long long* table, unsigned long long whole, unsigned long long* out) {
    copy_sum_row<8>(table, whole, out);
}

extern "C" __global__ void __launch_bounds__(1024) copy_sum_also(
        const unsigned long long* table, unsigned long long whole, unsigned long long* out) {
    copy_sum_row<9>(table, whole, out);
}
"""
