"""Collectives a partitioned request needs, on any torch.distributed backend: all-to-all
of variable row counts (gloo has no all_to_all, so counts go by all_gather and rows by
point-to-point sends), the concatenation and union of per-rank id rows, and sums of
dense vectors. Every rank calls each of them in the same order; bytes sent are counted
for the report."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


class Collectives:
    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.bytes_sent = 0  # payload bytes this rank sent to others since the last reset

    def _peers(self) -> list[int]:
        return [(self.rank + k) % self.world for k in range(1, self.world)]

    def counts(self, mine: np.ndarray) -> np.ndarray:
        """[world, world]: row r is rank r's `mine` (one int per rank)."""
        local = torch.from_numpy(np.ascontiguousarray(mine, dtype=np.int64))
        table = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(table, local)
        return torch.stack(table).numpy()

    def all_to_all(self, outgoing: list[tuple[torch.Tensor, torch.Tensor]], width: int,
                   dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """outgoing[r] = (int64 index [k], rows [k, width]) for rank r (own rank included);
        returns what every rank sent here, concatenated: (index, rows)."""
        sizes = self.counts(np.array([len(idx) for idx, _ in outgoing]))
        got_idx = [torch.empty(int(sizes[r, self.rank]), dtype=torch.int64) for r in range(self.world)]
        got_rows = [torch.empty((int(sizes[r, self.rank]), width), dtype=dtype) for r in range(self.world)]
        got_idx[self.rank], got_rows[self.rank] = outgoing[self.rank]
        works, keep = [], []
        for peer in self._peers():
            idx, rows = outgoing[peer]
            if len(idx):
                idx, rows = idx.contiguous(), rows.to(dtype).contiguous()
                keep += [idx, rows]
                works += [dist.isend(idx, peer, tag=0), dist.isend(rows, peer, tag=1)]
                self.bytes_sent += idx.numel() * 8 + rows.numel() * rows.element_size()
            if got_idx[peer].numel():
                works += [dist.irecv(got_idx[peer], peer, tag=0), dist.irecv(got_rows[peer], peer, tag=1)]
        for work in works:
            work.wait()
        return torch.cat(got_idx), torch.cat(got_rows).reshape(-1, width)

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
        table = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(table, padded)
        self.bytes_sent += mine.size * 8 * (self.world - 1)
        rows = torch.cat([t[: int(s)] for t, s in zip(table, sizes, strict=True)]).numpy()
        return rows.reshape(len(rows), *mine.shape[1:])

    def union(self, mine: np.ndarray) -> np.ndarray:
        """Sorted unique ids over every rank's `mine`."""
        return np.unique(self.gather(np.asarray(mine, dtype=np.int64).reshape(-1)))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks (each rank fills the entries it knows, zeros elsewhere)."""
        out = values.contiguous().clone()
        dist.all_reduce(out)
        self.bytes_sent += out.numel() * out.element_size()
        return out
