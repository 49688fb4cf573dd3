"""The CUDA C++ source of the delta scan kernel, compiled by :mod:`.copy_kernel` with the copy
and FP8 kernels and launched by :mod:`.delta_scan` (``dense`` on a GPU with CuPy).

``delta_scan``: one read of a bucket's previous and new bytes gives everything the encoder
must know before it sizes the payload, the numbers torch's masks gave in a dozen passes:
the changed elements of the element size the ``indices`` form compares, the changed 32-bit
words, for each ``d`` of 1 to ``GAP_WORDS + 1`` the pairs of consecutive changed words ``d``
apart (which XOR runs join), and both versions' bucket checksums (each 8-byte word weighted by
its checksum row position, as ``copy_sum`` takes them: ``take``). Each block covers one
contiguous chunk of 16-byte pairs of words, four loads in flight per thread; a changed word's
next two are read again for its neighbours (from cache). Each block adds its sums to ``out``
once, ``[changed, words, near_1 .. near_{G+1}, a_old, b_old, a_new, b_new]``, and writes its
own count of changed elements to ``counts``.

``delta_indices``: the ``indices`` form's parts (int32 flat indices, new values) in one more
read of both versions, each block's chunk written from the sum of the counts of the blocks
before it, in ascending order (torch's mask, ``nonzero_static`` and gather took three passes
and as many launches).

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

// Bit k: the k-th 32-bit word from the first of 8-byte word ``i`` (whose XOR is ``x``) changed.
__device__ __forceinline__ unsigned changed_words(unsigned long long x,
        const unsigned long long* o, const unsigned long long* c, unsigned long long i,
        unsigned long long n8) {{
    unsigned bits = (unsigned)((x & 0xffffffffull) != 0) | ((unsigned)((x >> 32) != 0) << 1);
#pragma unroll
    for (unsigned j = 1; j < 3; ++j) {{
        if (i + j >= n8) break;
        const unsigned long long y = o[i + j] ^ c[i + j];
        bits |= ((unsigned)((y & 0xffffffffull) != 0) | ((unsigned)((y >> 32) != 0) << 1))
                << (2 * j);
    }}
    return bits;
}}

// What one thread adds up. Named fields and fully unrolled loops keep them in registers: an
// array indexed by a loop the compiler cannot unroll lives in local memory, which made the
// scan four times slower than a copy of the same bytes.
struct ScanSums {{
    unsigned long long changed, words, near[DELTA_NEAR], a_old, b_old, a_new, b_new;
}};

// One 8-byte word ``i`` of both versions (``a`` old, ``b`` new) added to ``s``.
__device__ __forceinline__ void scan_word(const unsigned long long* o,
        const unsigned long long* c, unsigned long long a, unsigned long long b,
        unsigned long long i, unsigned long long n8, unsigned long long whole,
        unsigned long long unit, ScanSums& s) {{
    take(a, i, whole, s.a_old, s.b_old);
    take(b, i, whole, s.a_new, s.b_new);
    const unsigned long long x = a ^ b;
    if (!x) return;
    s.changed += changed_units(x, unit);
    const unsigned bits = changed_words(x, o, c, i, n8);
#pragma unroll
    for (unsigned k = 0; k < 2; ++k) {{
        if (!((bits >> k) & 1u)) continue;
        s.words += 1;
        // How far on the next changed word is (0: farther than DELTA_NEAR words).
        unsigned d = 0;
#pragma unroll
        for (unsigned e = DELTA_NEAR; e >= 1; --e)
            if ((bits >> (k + e)) & 1u) d = e;
#pragma unroll
        for (unsigned e = 1; e <= DELTA_NEAR; ++e) s.near[e - 1] += d == e;
    }}
}}

__device__ __forceinline__ unsigned long long low(const uint4& q) {{
    return ((unsigned long long)q.y << 32) | q.x;
}}

__device__ __forceinline__ unsigned long long high(const uint4& q) {{
    return ((unsigned long long)q.w << 32) | q.z;
}}

// The 16-byte pairs of words block ``blockIdx.x`` covers: [first, end).
__device__ __forceinline__ void chunk_of(unsigned long long n16, unsigned long long chunk,
        unsigned long long& first, unsigned long long& end) {{
    first = (unsigned long long)blockIdx.x * chunk;
    end = first + chunk < n16 ? first + chunk : n16;
}}

// Each block covers ``chunk`` 16-byte pairs of words (``n8`` is even: buckets are 256-byte
// multiples), its threads two pairs of each version apart by the block's width, both loaded
// before either is used (four loads in flight). ``counts[b]``: block b's changed elements,
// the offsets at which ``delta_indices`` writes its chunk's.
extern "C" __global__ void __launch_bounds__(1024) delta_scan(const unsigned long long* o,
        const unsigned long long* c, unsigned long long n8, unsigned long long whole,
        unsigned long long unit, unsigned long long* out, unsigned long long chunk,
        unsigned long long* counts) {{
    ScanSums s = {{}};
    const uint4* o4 = (const uint4*)o;
    const uint4* c4 = (const uint4*)c;
    unsigned long long first, end;
    chunk_of(n8 >> 1, chunk, first, end);
    for (unsigned long long i = first + threadIdx.x; i < end; i += 2ull * blockDim.x) {{
        const unsigned long long j = i + blockDim.x;
        const uint4 a0 = o4[i], b0 = c4[i];
        const uint4 a1 = j < end ? o4[j] : a0, b1 = j < end ? c4[j] : b0;
        scan_word(o, c, low(a0), low(b0), 2 * i, n8, whole, unit, s);
        scan_word(o, c, high(a0), high(b0), 2 * i + 1, n8, whole, unit, s);
        if (j < end) {{
            scan_word(o, c, low(a1), low(b1), 2 * j, n8, whole, unit, s);
            scan_word(o, c, high(a1), high(b1), 2 * j + 1, n8, whole, unit, s);
        }}
    }}
    unsigned long long v[DELTA_VALUES] = {{s.changed, s.words}};
#pragma unroll
    for (int k = 0; k < DELTA_NEAR; ++k) v[2 + k] = s.near[k];
    v[2 + DELTA_NEAR] = s.a_old;
    v[3 + DELTA_NEAR] = s.b_old;
    v[4 + DELTA_NEAR] = s.a_new;
    v[5 + DELTA_NEAR] = s.b_new;
#pragma unroll
    for (int k = 0; k < DELTA_VALUES; ++k)
#pragma unroll
        for (int t = 16; t > 0; t >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], t);
    __shared__ unsigned long long part[DELTA_VALUES][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0)
#pragma unroll
        for (int k = 0; k < DELTA_VALUES; ++k) part[k][warp] = v[k];
    __syncthreads();
    if (threadIdx.x < DELTA_VALUES) {{
        unsigned long long sum = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) sum += part[threadIdx.x][w];
        atomicAdd(out + threadIdx.x, sum);
        if (threadIdx.x == 0) counts[blockIdx.x] = sum;
    }}
}}

// The changed elements of ``T`` (``unit`` bytes) among a pair's two words: their flat indices
// and new values, written from ``at`` on.
template <class T>
__device__ __forceinline__ void put_changed(unsigned long long x, unsigned long long b,
        unsigned long long first, unsigned* idx, T* vals, unsigned long long& at) {{
    constexpr unsigned per = 8 / sizeof(T), bits = 8 * sizeof(T);
    constexpr unsigned long long mask = (1ull << bits) - 1ull;
#pragma unroll
    for (unsigned k = 0; k < per; ++k) {{
        if ((x >> (k * bits)) & mask) {{
            idx[at] = (unsigned)(first + k);
            vals[at] = (T)((b >> (k * bits)) & mask);
            ++at;
        }}
    }}
}}

// The ``indices`` form's parts in one read of both versions: block b walks the chunk
// ``delta_scan`` gave it, a tile of one pair per thread at a time; each thread's changed
// elements go after those of the block's earlier tiles and lower threads (a scan of the
// threads' counts by warp, then of the warps' sums), from ``offsets[b]`` (the blocks'
// exclusive sums of ``counts``) on. Indices in ascending order, as ``nonzero`` gives them.
extern "C" __global__ void __launch_bounds__(1024) delta_indices(const unsigned long long* o,
        const unsigned long long* c, unsigned long long n8, unsigned long long unit,
        unsigned long long chunk, const unsigned long long* offsets, unsigned* idx, void* vals) {{
    __shared__ unsigned long long warp_sums[32];
    const uint4* o4 = (const uint4*)o;
    const uint4* c4 = (const uint4*)c;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const unsigned long long per_word = 8 / unit;
    unsigned long long first, end, base = offsets[blockIdx.x];
    chunk_of(n8 >> 1, chunk, first, end);
    for (unsigned long long tile = first; tile < end; tile += blockDim.x) {{
        const unsigned long long i = tile + threadIdx.x;
        unsigned long long lo = 0, hi = 0, blo = 0, bhi = 0;
        if (i < end) {{
            const uint4 a = o4[i], b = c4[i];
            blo = low(b);
            bhi = high(b);
            lo = low(a) ^ blo;
            hi = high(a) ^ bhi;
        }}
        const unsigned long long count = changed_units(lo, unit) + changed_units(hi, unit);
        unsigned long long incl = count;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {{
            const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, d);
            if ((int)lane >= d) incl += y;
        }}
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        const unsigned long long mine = lane < warps ? warp_sums[lane] : 0;
        unsigned long long sums = mine;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {{
            const unsigned long long y = __shfl_up_sync(0xffffffffu, sums, d);
            if ((int)lane >= d) sums += y;
        }}
        const unsigned long long before = __shfl_sync(0xffffffffu, sums - mine, warp);
        const unsigned long long tile_total = __shfl_sync(0xffffffffu, sums, 31);
        unsigned long long at = base + before + incl - count;
        if (count) {{
            const unsigned long long w = 2 * i * per_word;
            if (unit == 2) {{
                put_changed(lo, blo, w, idx, (unsigned short*)vals, at);
                put_changed(hi, bhi, w + per_word, idx, (unsigned short*)vals, at);
            }} else if (unit == 4) {{
                put_changed(lo, blo, w, idx, (unsigned*)vals, at);
                put_changed(hi, bhi, w + per_word, idx, (unsigned*)vals, at);
            }} else {{
                put_changed(lo, blo, w, idx, (unsigned char*)vals, at);
                put_changed(hi, bhi, w + per_word, idx, (unsigned char*)vals, at);
            }}
        }}
        base += tile_total;
        __syncthreads();
    }}
}}
"""
