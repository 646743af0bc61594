"""Halo exchange: each rank receives exactly the rows its in-edges need from other ranks.

The plan is made once (who needs which of my rows); each layer then sends the owners'
rows of the previous layer (features, never graph tiles) in chunks of bounded size, by
point-to-point sends and receives: gloo has no all_to_all, and the chunks let a rank
compute the targets whose halo rows have arrived while later chunks are still in flight.
Receives land in place, in the halo rows of the layer's input tensor.

Under NCCL the sends and receives of an exchange are posted as one batch
(batch_isend_irecv): NCCL runs a pair of ranks' point-to-point operations in order on one
stream, so two ranks that each post their receive from the other before their send to it
would wait for each other for ever. A batch is one NCCL group: its operations proceed
together, matched per pair in the order they were posted (as gloo matches them by tag).
A layer's chunks then all arrive together. HYBRIDGNN_HALO_BATCHED=1 batches under gloo
too (the tests check the batched exchange on CPU that way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hybridgnn.distributed.partition import LocalPart


def _batched() -> bool:
    """Whether an exchange is posted as one batch (see the module docstring)."""
    return dist.get_backend() == "nccl" or os.environ.get("HYBRIDGNN_HALO_BATCHED") == "1"


def _post(ops: list[tuple[bool, torch.Tensor, int, int]], batched: bool) -> list:
    """Post (is_send, tensor, peer, tag) operations, in this order: one by one, or as one
    batch. Their Work handles: one per operation unbatched; a batch's may be fewer (NCCL
    coalesces them), and every handle must be waited for."""
    if not ops:
        return []
    if batched:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, peer, tag=tag)
                                       for send, t, peer, tag in ops])
    return [(dist.isend if send else dist.irecv)(t, peer, tag=tag) for send, t, peer, tag in ops]


def _chunks(count: int, chunk_rows: int) -> list[tuple[int, int]]:
    return [(lo, min(count, lo + chunk_rows)) for lo in range(0, count, chunk_rows)]


def target_groups(part: LocalPart, chunks: list[tuple[int, int]]) -> list[np.ndarray]:
    """part's targets grouped by the last halo chunk they wait for: group 0 needs no halo
    row, group j+1 can run once chunks 0..j arrived (chunks are halo row ranges)."""
    n, halo_rows = part.num_nodes, len(part.halo)
    chunk_of = np.empty(halo_rows, dtype=np.int64)
    for j, (a, b) in enumerate(chunks):
        chunk_of[a:b] = j
    cols = part.indices
    waits = np.full(len(cols), -1, dtype=np.int64)
    remote = cols >= n
    waits[remote] = chunk_of[cols[remote] - n]
    last = np.full(n, -1, dtype=np.int64)
    nonempty = np.diff(part.indptr) > 0
    if nonempty.any():  # rows are contiguous segments of cols: one reduceat over their starts
        last[nonempty] = np.maximum.reduceat(waits, part.indptr[:-1][nonempty])
    order = np.argsort(last, kind="stable")
    bounds = np.searchsorted(last[order], np.arange(-1, len(chunks) + 1), side="left")
    return [order[bounds[j]:bounds[j + 1]] for j in range(len(chunks) + 1)]


@dataclass
class Transfer:
    """A layer's exchange in flight: receives in halo order, then the sends to finish."""

    chunks: list[tuple[int, int]]   # halo row ranges, in the order they are awaited
    receives: list                  # their Work handles, same order (unbatched)
    sends: list                     # Work handles of this rank's sends (batched: the whole batch's)
    keep: list                      # send buffers, alive until their sends finish
    bytes_sent: int
    batched: bool = False           # posted as one batch: every chunk arrives with the batch
    waited: bool = False            # the batch's handles were waited for (a handle is waited once:
                                    # gloo's receive waits for another message on a second wait)

    def wait_chunk(self, j: int) -> None:
        if not self.batched:
            self.receives[j].wait()
        elif not self.waited:
            self._wait_sends()  # the batch's handles: once they are done, so is every chunk

    def finish(self) -> None:
        if not self.waited:
            self._wait_sends()
        self.keep.clear()

    def _wait_sends(self) -> None:
        self.waited = True
        for work in self.sends:
            work.wait()


class HaloPlan:
    """Which of this rank's rows every other rank needs, and where its own halo comes from.
    Collective: every rank builds its plan at the same time."""

    def __init__(self, part: LocalPart, device: torch.device):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.part = part
        self.device = device
        mine = self._to(torch.from_numpy(part.halo_counts.astype(np.int64)))
        table = [torch.zeros_like(mine) for _ in range(self.world)]  # on mine's device: NCCL gathers there
        dist.all_gather(table, mine)
        self.counts = torch.stack([t.cpu() for t in table]).numpy()  # counts[r, s]: rows r receives from s
        self.recv_offsets = np.concatenate([[0], np.cumsum(part.halo_counts)])
        # Tell each owner which of its rows this rank needs (global ids, in halo order).
        wanted = [torch.empty(int(self.counts[s, self.rank]), dtype=torch.int64) for s in range(self.world)]
        own_halo = torch.from_numpy(part.halo)
        ops, sending = [], []  # send buffers stay referenced until their sends finish
        for peer in self._peers():
            lo, hi = self.recv_offsets[peer], self.recv_offsets[peer + 1]
            if hi > lo:
                sending.append(self._to(own_halo[lo:hi]))
                ops.append((True, sending[-1], peer, 0))
            if wanted[peer].numel():
                wanted[peer] = self._to(wanted[peer])
                ops.append((False, wanted[peer], peer, 0))
        for work in _post(ops, _batched()):
            work.wait()
        self.send_index: list[torch.Tensor] = []
        for peer in range(self.world):
            ids = wanted[peer].cpu().numpy()
            local = np.searchsorted(part.nodes, ids)
            if len(ids) and (local.max() >= len(part.nodes) or not np.array_equal(part.nodes[local], ids)):
                raise RuntimeError(f"rank {peer} asked rank {self.rank} for rows it does not own")
            self.send_index.append(torch.from_numpy(local.astype(np.int64)).to(device))

    def _peers(self) -> list[int]:
        # start with the next rank, so that not every rank talks to rank 0 first
        return [(self.rank + k) % self.world for k in range(1, self.world)]

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device.type == "cuda" else t

    @property
    def halo_rows(self) -> int:
        return int(self.recv_offsets[-1])

    def start(self, rows: torch.Tensor, chunk_rows: int) -> Transfer:
        """Send each peer its rows of `rows` (this rank's [n + h, d] layer input: own rows
        first) and receive the halo into rows[n:], in chunks of at most chunk_rows rows."""
        n = self.part.num_nodes
        ops, keep, order, sent = [], [], [], 0
        for peer in self._peers():
            lo, hi = int(self.recv_offsets[peer]), int(self.recv_offsets[peer + 1])
            for tag, (a, b) in enumerate(_chunks(hi - lo, chunk_rows)):
                ops.append((False, rows[n + lo + a:n + lo + b], peer, tag))
                order.append((lo + a, lo + b))
            index = self.send_index[peer]
            if index.numel():
                payload = rows.index_select(0, index)
                keep.append(payload)
                sent += payload.numel() * payload.element_size()
                for tag, (a, b) in enumerate(_chunks(index.numel(), chunk_rows)):
                    ops.append((True, payload[a:b], peer, tag))
        batched = _batched()
        works = _post(ops, batched)
        if batched:
            return Transfer(chunks=order, receives=[], sends=works, keep=keep, bytes_sent=sent, batched=True)
        receives = [w for w, op in zip(works, ops, strict=True) if not op[0]]
        sends = [w for w, op in zip(works, ops, strict=True) if op[0]]
        return Transfer(chunks=order, receives=receives, sends=sends, keep=keep, bytes_sent=sent)

    def gather(self, own: torch.Tensor) -> torch.Tensor:
        """[n + h, ...]: own rows then the halo rows, blocking (for one-off tables)."""
        rows = torch.empty((self.part.num_nodes + self.halo_rows, *own.shape[1:]), dtype=own.dtype,
                           device=own.device)
        rows[:self.part.num_nodes] = own
        transfer = self.start(rows, max(1, rows.shape[0]))
        for j in range(len(transfer.chunks)):
            transfer.wait_chunk(j)
        transfer.finish()
        return rows

    def target_groups(self, chunks: list[tuple[int, int]]) -> list[np.ndarray]:
        return target_groups(self.part, chunks)
