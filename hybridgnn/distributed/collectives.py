"""Collectives a partitioned request needs, on any torch.distributed backend: all-to-all
of variable row counts (gloo has no all_to_all, so counts go by all_gather and rows by
point-to-point sends), the concatenation and union of per-rank id rows, and sums of
dense vectors. Every rank calls each of them in the same order; bytes sent are counted
for the report.

Callers hand in and get back host tensors whatever the backend: under NCCL (ranks with
--device cuda) each exchange goes through the rank's GPU (all_to_all_single, which
NCCL has), so the layers still compute on the host and only the transport changes."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def backend_device() -> torch.device | None:
    """The device the group's backend exchanges from: this rank's GPU under NCCL, else
    None (host tensors)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def broadcast(tensor: torch.Tensor, src: int = 0, *, idle: bool = False) -> torch.Tensor:
    """dist.broadcast on any backend; returns src's tensor as a host tensor (on src, the
    tensor given). idle: the wait may be long (a rank waiting for the next call), so under
    NCCL it sleeps instead of spinning a core."""
    device = backend_device()
    if device is None:
        dist.broadcast(tensor, src)
        return tensor
    moved = tensor.to(device)
    dist.broadcast(moved, src)  # queued: this thread's stream waits for it, the host does not
    if idle:
        # .cpu() alone waits in cudaStreamSynchronize, which spins a core for as long as the
        # broadcast takes (CUDA's default schedule spins while a process has no more GPU
        # contexts than the machine has cores): an idle NCCL rank kept a core busy. A
        # blocking event's synchronize sleeps until the GPU signals it.
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()
    return moved.cpu()


class Collectives:
    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.bytes_sent = 0  # payload bytes this rank sent to others since the last reset
        self.device = backend_device()

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device is None else tensor.to(self.device)

    def _empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _peers(self) -> list[int]:
        return [(self.rank + k) % self.world for k in range(1, self.world)]

    def counts(self, mine: np.ndarray) -> np.ndarray:
        """[world, world]: row r is rank r's `mine` (one int per rank)."""
        local = self._out(torch.from_numpy(np.ascontiguousarray(mine, dtype=np.int64)))
        table = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(table, local)
        return torch.stack(table).cpu().numpy()

    def all_to_all(self, outgoing: list[tuple[torch.Tensor, torch.Tensor]], width: int,
                   dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """outgoing[r] = (int64 index [k], rows [k, width]) for rank r (own rank included);
        returns what every rank sent here, concatenated: (index, rows)."""
        sizes = self.counts(np.array([len(idx) for idx, _ in outgoing]))
        if self.device is not None:
            return self._all_to_all_single(outgoing, sizes, width, dtype)
        got_idx = [torch.empty(int(sizes[r, self.rank]), dtype=torch.int64) for r in range(self.world)]
        got_rows = [torch.empty((int(sizes[r, self.rank]), width), dtype=dtype) for r in range(self.world)]
        got_idx[self.rank], got_rows[self.rank] = outgoing[self.rank]
        ops = []  # gloo: one batch of point-to-point sends, as it has no all_to_all
        for peer in self._peers():
            idx, rows = outgoing[peer]
            if len(idx):
                idx, rows = idx.contiguous(), rows.to(dtype).contiguous()
                ops += [dist.P2POp(dist.isend, idx, peer, tag=0), dist.P2POp(dist.isend, rows, peer, tag=1)]
                self.bytes_sent += idx.numel() * 8 + rows.numel() * rows.element_size()
            if got_idx[peer].numel():
                ops += [dist.P2POp(dist.irecv, got_idx[peer], peer, tag=0),
                        dist.P2POp(dist.irecv, got_rows[peer], peer, tag=1)]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return torch.cat(got_idx), torch.cat(got_rows).reshape(-1, width)

    def _all_to_all_single(self, outgoing, sizes: np.ndarray, width: int, dtype):
        """all_to_all under NCCL, which has it: one call for the indices, one for the rows."""
        sends = [int(len(idx)) for idx, _ in outgoing]
        recvs = [int(v) for v in sizes[:, self.rank]]
        idx = self._out(torch.cat([i.reshape(-1) for i, _ in outgoing]).to(torch.int64).contiguous())
        rows = self._out(torch.cat([r.to(dtype).reshape(-1, width) for _, r in outgoing]).contiguous())
        got_idx = self._empty(sum(recvs), torch.int64)
        got_rows = self._empty((sum(recvs), width), dtype)
        dist.all_to_all_single(got_idx, idx, recvs, sends)
        dist.all_to_all_single(got_rows, rows, recvs, sends)
        others = sum(sends) - sends[self.rank]
        self.bytes_sent += others * 8 + others * width * rows.element_size()
        return got_idx.cpu(), got_rows.cpu()

    def gather(self, mine: np.ndarray) -> np.ndarray:
        """Every rank's int64 rows `mine` [k, c] (c alike on all ranks), concatenated in
        rank order."""
        mine = np.asarray(mine, dtype=np.int64)
        width = int(np.prod(mine.shape[1:]))
        sizes = self.counts(np.array([len(mine)]))[:, 0]
        longest = int(sizes.max()) if len(sizes) else 0
        if longest == 0:
            return np.empty((0, *mine.shape[1:]), dtype=np.int64)
        padded = torch.zeros((longest, width), dtype=torch.int64)
        padded[: len(mine)] = torch.from_numpy(mine.reshape(len(mine), width))
        padded = self._out(padded)
        table = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(table, padded)
        self.bytes_sent += mine.size * 8 * (self.world - 1)
        rows = torch.cat([t[: int(s)] for t, s in zip(table, sizes, strict=True)]).cpu().numpy()
        return rows.reshape(len(rows), *mine.shape[1:])

    def union(self, mine: np.ndarray) -> np.ndarray:
        """Sorted unique ids over every rank's `mine`."""
        return np.unique(self.gather(np.asarray(mine, dtype=np.int64).reshape(-1)))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks (each rank fills the entries it knows, zeros elsewhere)."""
        out = self._out(values.contiguous().clone())
        dist.all_reduce(out)
        self.bytes_sent += out.numel() * out.element_size()
        return out.cpu()
