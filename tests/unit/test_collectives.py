"""The host side of collectives under NCCL, without a GPU: what a broadcast waits in."""

from __future__ import annotations

import torch

from hybridgnn.distributed import collectives


class FakeEvent:
    made: list[FakeEvent] = []

    def __init__(self, blocking: bool = False, **_):
        self.blocking, self.calls = blocking, []
        FakeEvent.made.append(self)

    def record(self, stream=None):
        self.calls.append("record")

    def synchronize(self):
        self.calls.append("synchronize")


def _nccl_stand_in(monkeypatch):
    """backend_device as under NCCL (the host stands in for the GPU), broadcasts logged."""
    FakeEvent.made = []
    sent = []
    monkeypatch.setattr(collectives, "backend_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(collectives.dist, "broadcast", lambda t, src: sent.append(t.clone()))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return sent


def test_an_idle_wait_under_nccl_sleeps_on_a_blocking_event_before_reading_back(monkeypatch):
    """A follower waiting for rank 0's next call read it back with .cpu() at once, whose
    stream synchronize spins a core until the broadcast ends: an idle NCCL rank used a
    whole core. It now waits on a blocking event (the thread sleeps) first."""
    sent = _nccl_stand_in(monkeypatch)
    got = collectives.broadcast(torch.tensor([3, 0]), idle=True)
    assert got.tolist() == [3, 0] and len(sent) == 1
    assert len(FakeEvent.made) == 1
    assert FakeEvent.made[0].blocking and FakeEvent.made[0].calls == ["record", "synchronize"]


def test_a_broadcast_within_a_call_reads_back_at_once(monkeypatch):
    """Within a call the ranks are all there: no event (a blocking one wakes later)."""
    _nccl_stand_in(monkeypatch)
    assert collectives.broadcast(torch.tensor([1, 2])).tolist() == [1, 2]
    assert FakeEvent.made == []


def test_a_follower_waits_for_the_next_call_as_an_idle_wait(monkeypatch):
    from hybridgnn.distributed import rank_server

    waits = []

    def broadcast(tensor, src=0, *, idle=False):
        waits.append(idle)
        return torch.tensor([7, 0]) if len(waits) == 1 else tensor

    monkeypatch.setattr(rank_server, "broadcast", broadcast)
    kind, payload = rank_server._next_call()
    assert (kind, len(payload)) == (7, 0) and waits == [True]
