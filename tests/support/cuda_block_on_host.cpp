// Runs a one-block CUDA kernel's source on the CPU: one std::thread per CUDA thread,
// a std::barrier for __syncthreads, std::atomic_ref for atomicMin, `static` for
// __shared__ (one block, so one copy is right). Built by tests/integration with the
// kernel source as kernel.inc and HOST_INDEX_T / HOST_THREADS defined; under
// -fsanitize=thread a missing barrier shows as a data race.
//
// stdin (int64 little-endian): num_nodes, nnz, hops, count, indptr[num_nodes + 1],
// indices[nnz] (as int64, narrowed to HOST_INDEX_T), params[2 * hops + count].
// stdout (int64): counts[2 * hops + 2], nodes[total nodes], edges[2 * total edges],
// then 1 if the scratch maps were left as found, else 0.
#include <thread>

#include "cuda_host_shim.h"
#include "kernel.inc"

int main() {
    std::vector<long long> head = read_int64(4);
    const long long num_nodes = head[0], nnz = head[1], count = head[3];
    const int hops = (int)head[2];
    std::vector<long long> indptr = read_int64(num_nodes + 1);
    std::vector<long long> wide = read_int64(nnz);
    std::vector<HOST_INDEX_T> indices(wide.begin(), wide.end());
    std::vector<long long> params = read_int64(2 * hops + count);

    long long rows = count, tile_cap = 0, total_tiles = 0;
    for (int h = 0; h < hops; ++h) {
        long long t = rows * params[h];
        tile_cap = t > tile_cap ? t : tile_cap;
        total_tiles += t;
        rows = t < num_nodes ? t : num_nodes;
    }
    const long long max64 = std::numeric_limits<long long>::max();
    std::vector<long long> local(num_nodes, -1), bid(num_nodes, max64);
    std::vector<long long> tile(tile_cap + 1), nodes(count + total_tiles + 1);
    std::vector<long long> edges(2 * total_tiles + 1), dst_tmp(total_tiles + 1), counts(2 * hops + 2);

    std::barrier<> barrier(HOST_THREADS);
    host_barrier = &barrier;
    blockDim.x = HOST_THREADS;
    gridDim.x = 1;
    std::vector<std::thread> threads;
    for (unsigned int t = 0; t < HOST_THREADS; ++t) {
        threads.emplace_back([&, t] {
            threadIdx.x = t;
            sample_small(indptr.data(), indices.data(), params.data(), hops, count, local.data(), bid.data(),
                         tile.data(), nodes.data(), edges.data(), dst_tmp.data(), counts.data());
        });
    }
    for (auto& thread : threads) thread.join();

    long long total_nodes = counts[hops + 1], total_edges = 0;
    for (int h = 0; h < hops; ++h) total_edges += counts[hops + 2 + h];
    long long clean = 1;
    for (long long v = 0; v < num_nodes; ++v) clean &= (local[v] == -1 && bid[v] == max64) ? 1 : 0;
    write_int64(counts.data(), counts.size());
    write_int64(nodes.data(), total_nodes);
    write_int64(edges.data(), 2 * total_edges);
    write_int64(&clean, 1);
    return 0;
}
