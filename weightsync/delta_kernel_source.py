"""The CUDA C++ source of the delta scan kernel, compiled by :mod:`.copy_kernel` with the copy
and FP8 kernels and launched by :mod:`.delta_scan` (``dense`` on a GPU with CuPy).

``delta_scan``: one read of a bucket's previous and new bytes gives everything the encoder
must know before it sizes the payload, the numbers torch's masks gave in a dozen passes:
the changed elements of the element size the ``indices`` form compares, the changed 32-bit
words, for each ``d`` of 1 to ``GAP_WORDS + 1`` the pairs of consecutive changed words ``d``
apart (which XOR runs join), and both versions' bucket checksums (each 8-byte word weighted by
its checksum row position, as ``copy_sum`` takes them: ``take``). Threads walk the 8-byte
words; a word's next two are read again for its neighbours (from cache). Each block adds its
sums to ``out`` once: ``[changed, words, near_1 .. near_{G+1}, a_old, b_old, a_new, b_new]``.
The tests compile this same source for the CPU (``tests/support/cuda_on_cpu.py``).
"""

NEAR = 3
"""``delta_scan.GAP_WORDS + 1``: the farthest apart two changed words can be and still join one
XOR run (a test holds the two equal; this module imports nothing, the copy kernels' does)."""
SCAN_VALUES = 2 + NEAR + 4
"""The values ``delta_scan`` adds into ``out``."""

SOURCE = rf"""
#define DELTA_NEAR {NEAR}
#define DELTA_VALUES {SCAN_VALUES}

// The changed elements of ``unit`` bytes among the eight bytes of ``x`` (an XOR): each
// element's bits folded onto its lowest, then counted.
__device__ __forceinline__ unsigned changed_units(unsigned long long x, unsigned long long unit) {{
    if (unit == 4) return (unsigned)((x & 0xffffffffull) != 0) + (unsigned)((x >> 32) != 0);
    if (unit == 2) {{
        x |= x >> 8;
        x |= x >> 4;
        x |= x >> 2;
        x |= x >> 1;
        return (unsigned)__popcll(x & 0x0001000100010001ull);
    }}
    x |= x >> 4;
    x |= x >> 2;
    x |= x >> 1;
    return (unsigned)__popcll(x & 0x0101010101010101ull);
}}

// Bit k: the k-th 32-bit word from the first of 8-byte word ``i`` changed (k < 2 * left).
__device__ __forceinline__ unsigned changed_words(const unsigned long long* o,
        const unsigned long long* c, unsigned long long i, unsigned long long n8) {{
    unsigned bits = 0;
    for (unsigned j = 0; j < 3 && i + j < n8; ++j) {{
        const unsigned long long x = o[i + j] ^ c[i + j];
        bits |= ((unsigned)((x & 0xffffffffull) != 0) | ((unsigned)((x >> 32) != 0) << 1))
                << (2 * j);
    }}
    return bits;
}}

extern "C" __global__ void __launch_bounds__(1024) delta_scan(const unsigned long long* o,
        const unsigned long long* c, unsigned long long n8, unsigned long long whole,
        unsigned long long unit, unsigned long long* out) {{
    unsigned long long v[DELTA_VALUES];
    for (int k = 0; k < DELTA_VALUES; ++k) v[k] = 0;
    const unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
            i < n8; i += step) {{
        const unsigned long long a = o[i], b = c[i];
        take(a, i, whole, v[2 + DELTA_NEAR], v[3 + DELTA_NEAR]);
        take(b, i, whole, v[4 + DELTA_NEAR], v[5 + DELTA_NEAR]);
        const unsigned long long x = a ^ b;
        if (!x) continue;
        v[0] += changed_units(x, unit);
        const unsigned bits = changed_words(o, c, i, n8);
        for (unsigned k = 0; k < 2; ++k) {{
            if (!((bits >> k) & 1u)) continue;
            v[1] += 1;
            // The next changed word, if it is at most DELTA_NEAR words on.
            for (unsigned d = 1; d <= DELTA_NEAR; ++d) {{
                if ((bits >> (k + d)) & 1u) {{
                    v[1 + d] += 1;
                    break;
                }}
            }}
        }}
    }}
    for (int k = 0; k < DELTA_VALUES; ++k)
        for (int s = 16; s > 0; s >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], s);
    __shared__ unsigned long long part[DELTA_VALUES][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0)
        for (int k = 0; k < DELTA_VALUES; ++k) part[k][warp] = v[k];
    __syncthreads();
    if (threadIdx.x < DELTA_VALUES) {{
        unsigned long long sum = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) sum += part[threadIdx.x][w];
        atomicAdd(out + threadIdx.x, sum);
    }}
}}
"""
