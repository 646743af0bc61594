// Runs pipelines/cuda_lay_out.py's kernel source on the CPU: a kernel with no barrier, so
// every (block, thread) of its grid runs in turn on one thread. Built by tests/integration
// with the source (elements as unsigned int) in kernel.inc.
//
// stdin (int64): row_elems, total_nodes, num_edges, hops, edge_slots, slots,
// x[total_nodes * row_elems] (narrowed to 32 bits), src[num_edges], dst[num_edges],
// plan[4 * hops + 6].
// stdout (int64): bucket_x[slots * row_elems] (zero where nothing was written),
// bucket_edges[2 * edge_slots] (-7 where nothing was written).
#include "cuda_host_shim.h"
#include "kernel.inc"

int main() {
    std::vector<long long> head = read_int64(6);
    const long long row_elems = head[0], total_nodes = head[1], num_edges = head[2], edge_slots = head[4];
    const long long slots = head[5];
    const int hops = (int)head[3];
    std::vector<long long> wide = read_int64(total_nodes * row_elems);
    std::vector<unsigned int> x(wide.begin(), wide.end());
    std::vector<long long> src = read_int64(num_edges), dst = read_int64(num_edges);
    std::vector<long long> plan = read_int64(4 * hops + 6);
    std::vector<unsigned int> bucket_x(slots * row_elems, 0u);
    std::vector<long long> bucket_edges(2 * edge_slots, -7);

    const long long threads = 64, n = total_nodes * row_elems + edge_slots;
    blockDim.x = threads;
    gridDim.x = (unsigned int)((n + threads - 1) / threads);
    for (unsigned int b = 0; b < gridDim.x; ++b) {
        blockIdx.x = b;
        for (unsigned int t = 0; t < threads; ++t) {
            threadIdx.x = t;
            lay_out(x.data(), row_elems, src.data(), dst.data(), plan.data(), hops, bucket_x.data(),
                    bucket_edges.data(), edge_slots);
        }
    }
    std::vector<long long> out_x(bucket_x.begin(), bucket_x.end());
    write_int64(out_x.data(), out_x.size());
    write_int64(bucket_edges.data(), bucket_edges.size());
    return 0;
}
