// CUDA's device-side names for a kernel's source compiled as C++ on the CPU (tests):
// threadIdx per std::thread, one block's __syncthreads as a std::barrier the harness
// sets, atomicMin relaxed as CUDA's is, __shared__ as static (one block, one copy).
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

struct HostDim3 {
    unsigned int x = 0, y = 0, z = 0;
};
thread_local HostDim3 threadIdx;
HostDim3 blockIdx, blockDim, gridDim;
std::barrier<>* host_barrier = nullptr;

inline void __syncthreads() { host_barrier->arrive_and_wait(); }

// Relaxed, as CUDA's atomics are: a seq_cst shim would order threads that a GPU does not,
// and hide a missing barrier from ThreadSanitizer.
inline long long atomicMin(long long* address, long long value) {
    std::atomic_ref<long long> cell(*address);
    long long seen = cell.load(std::memory_order_relaxed);
    while (value < seen && !cell.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
    return seen;
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static

// The harnesses' input and output: little-endian int64 on stdin and stdout.
static std::vector<long long> read_int64(size_t n) {
    std::vector<long long> out(n);
    if (n && std::fread(out.data(), sizeof(long long), n, stdin) != n) {
        std::fprintf(stderr, "short input\n");
        std::exit(2);
    }
    return out;
}

static void write_int64(const long long* data, size_t n) { std::fwrite(data, sizeof(long long), n, stdout); }
