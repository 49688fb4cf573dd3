"""Our CUDA kernels' own source, compiled for the CPU with g++ and run there, block by block.

The kernels (``weightsync/copy_kernel_source.py``, ``weightsync/fp8_kernel_source.py``,
``weightsync/delta_kernel_source.py``) only launch on a GPU, which CI does not have. A few
lines of C++ stand in for what they use of CUDA: each block's threads are real threads
(``threadIdx``), ``__syncthreads`` a barrier among them, ``__shared__`` memory shared by them,
the warp shuffles (``__shfl_down_sync``, ``__shfl_up_sync``, ``__shfl_sync``) an exchange
between two barriers, ``atomicAdd`` an atomic add, ``__popcll`` the compiler's bit count, the
float intrinsics the CPU's float arithmetic (both round to nearest even), and a misaligned load
or store stops the process (as it would fault on a GPU).
Blocks run one after another. The kernels then read and write CPU memory at the addresses in
their tables, so a test can compare what they did with torch's answer, bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from weightsync import copy_kernel

_SHIM = r"""
#include <barrier>
#include <cstring>
#include <thread>
#include <vector>

struct dim3_ { unsigned x, y, z; };
static thread_local dim3_ threadIdx, blockIdx;
static dim3_ blockDim, gridDim;
static std::barrier<>* block_barrier;
// Aligned like CUDA's (the sanitizer checks its loads against 16 bytes), copied a field at a
// time so that a misaligned one is reported rather than faulting here.
struct alignas(16) uint4 {
    unsigned x, y, z, w;
    uint4() = default;
    uint4(const uint4& o) : x(o.x), y(o.y), z(o.z), w(o.w) {}
    uint4& operator=(const uint4& o) { x = o.x; y = o.y; z = o.z; w = o.w; return *this; }
};
#define __global__
#define __launch_bounds__(threads)
#define __device__
#define __forceinline__ inline
#define __shared__ static

static void __syncthreads() { block_barrier->arrive_and_wait(); }

// A warp's exchanges: each thread's value from lane ``from(lane)`` of its warp (its own where
// that is outside the warp or the block), between two barriers (every thread takes part).
static unsigned long long shuffled[1024];
template <class F>
static unsigned long long exchange(unsigned long long v, F from) {
    const unsigned t = threadIdx.x, lane = t & 31u, warp = t - lane;
    shuffled[t] = v;
    __syncthreads();
    const int src = from((int)lane);
    const bool inside = src >= 0 && src < 32 && warp + (unsigned)src < blockDim.x;
    const unsigned long long got = inside ? shuffled[warp + src] : v;
    __syncthreads();
    return got;
}
static unsigned long long __shfl_down_sync(unsigned, unsigned long long v, int offset) {
    return exchange(v, [=](int lane) { return lane + offset; });
}
static unsigned long long __shfl_up_sync(unsigned, unsigned long long v, int offset) {
    return exchange(v, [=](int lane) { return lane - offset; });
}
static unsigned long long __shfl_sync(unsigned, unsigned long long v, int lane) {
    return exchange(v, [=](int) { return lane; });
}

static float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// Rounded to nearest even, as the CPU does in float (no contraction: x86-64 has no FMA here).
static float __fadd_rn(float a, float b) { return a + b; }
static float __fmul_rn(float a, float b) { return a * b; }
static float __fdiv_rn(float a, float b) { return a / b; }

static int __popcll(unsigned long long x) { return __builtin_popcountll(x); }

static unsigned long long atomicAdd(unsigned long long* at, unsigned long long v) {
    return __atomic_fetch_add(at, v, __ATOMIC_SEQ_CST);
}
"""

_LAUNCHERS = r"""
template <class F>
static void grid(unsigned blocks, unsigned threads, F body) {
    blockDim = {threads, 1, 1};
    gridDim = {blocks, 1, 1};
    for (unsigned b = 0; b < blocks; ++b) {
        std::barrier<> barrier(threads);
        block_barrier = &barrier;
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t)
            pool.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {b, 0, 0}; body(); });
        for (auto& th : pool) th.join();
    }
}

extern "C" void launch_copy_chunks(unsigned blocks, unsigned threads,
                                   const unsigned long long* table) {
    grid(blocks, threads, [=] { copy_chunks(table); });
}

extern "C" void launch_copy_sum(unsigned blocks, unsigned threads,
                                const unsigned long long* table, unsigned long long whole,
                                unsigned long long* out) {
    grid(blocks, threads, [=] { copy_sum(table, whole, out); });
}

extern "C" void launch_copy_sum_also(unsigned blocks, unsigned threads,
                                     const unsigned long long* table, unsigned long long whole,
                                     unsigned long long* out) {
    grid(blocks, threads, [=] { copy_sum_also(table, whole, out); });
}

extern "C" void launch_delta_scan(unsigned blocks, unsigned threads,
                                  const unsigned long long* old, const unsigned long long* cur,
                                  unsigned long long n8, unsigned long long whole,
                                  unsigned long long unit, unsigned long long* out,
                                  unsigned long long chunk, unsigned long long* counts) {
    grid(blocks, threads, [=] { delta_scan(old, cur, n8, whole, unit, out, chunk, counts); });
}

extern "C" void launch_delta_indices(unsigned blocks, unsigned threads,
                                     const unsigned long long* old, const unsigned long long* cur,
                                     unsigned long long n8, unsigned long long unit,
                                     unsigned long long chunk, const unsigned long long* offsets,
                                     unsigned* idx, void* vals) {
    grid(blocks, threads, [=] { delta_indices(old, cur, n8, unit, chunk, offsets, idx, vals); });
}

extern "C" void launch_quantize_fp8(unsigned blocks, unsigned threads,
                                    const unsigned long long* table, unsigned long long tensors,
                                    unsigned long long ue8m0) {
    grid(blocks, threads, [=] { quantize_fp8(table, tensors, ue8m0); });
}
"""


def compiler() -> str | None:
    """g++, where it has the sanitizer runtime that reports misaligned loads (else None)."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    found = subprocess.run([gxx, "-print-file-name=libubsan.so"], capture_output=True, text=True)
    return gxx if Path(found.stdout.strip()).exists() else None


@functools.cache
def kernels() -> ctypes.CDLL:
    """The kernels of ``copy_kernel.SOURCE`` built for this CPU: ``launch_<kernel>`` takes
    the block count, the threads per block, then the kernel's arguments."""
    build = Path(tempfile.mkdtemp(prefix="ws-kernels-"))
    (build / "kernels.cpp").write_text(_SHIM + copy_kernel.SOURCE + _LAUNCHERS)
    # A load or store at an address its type does not align to is reported (a GPU would
    # fault; x86 does not care): see launch().
    cmd = [compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread"]
    cmd += ["-fsanitize=alignment", "kernels.cpp", "-o", "kernels.so"]
    subprocess.run(cmd, cwd=build, check=True, capture_output=True)
    lib = ctypes.CDLL(str(build / "kernels.so"))
    shutil.rmtree(build)  # the loaded library stays mapped
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    lib.launch_copy_chunks.argtypes = [u32, u32, u64]
    lib.launch_copy_sum.argtypes = [u32, u32, u64, u64, u64]
    lib.launch_copy_sum_also.argtypes = [u32, u32, u64, u64, u64]
    lib.launch_quantize_fp8.argtypes = [u32, u32, u64, u64, u64]
    lib.launch_delta_scan.argtypes = [u32, u32, u64, u64, u64, u64, u64, u64, u64, u64]
    lib.launch_delta_indices.argtypes = [u32, u32, u64, u64, u64, u64, u64, u64, u64, u64]
    return lib


def launch(kernel: str, blocks: int, *args: int) -> None:
    """Run ``kernel`` over ``blocks`` blocks of its threads (``copy_kernel.KERNELS``).

    Raises:
        AssertionError: it loaded or stored at a misaligned address (the sanitizer's report).
    """
    lib = kernels()
    with tempfile.TemporaryFile() as report:
        saved = os.dup(2)  # the sanitizer writes to stderr
        os.dup2(report.fileno(), 2)
        try:
            getattr(lib, f"launch_{kernel}")(blocks, copy_kernel.KERNELS[kernel], *args)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        report.seek(0)
        text = report.read().decode(errors="replace")
    assert "runtime error" not in text, f"{kernel} would fault on a GPU:\n{text}"
