"""Per model version counts and cumulative times, in the form Triton's statistics
extension reports them (GET /v2/models/{m}[/versions/{v}]/stats; gRPC ModelStatistics).

Updated on the event loop only (answers and completed batches), read by the endpoint.
"""

from __future__ import annotations

import time

from hybridgnn.types import StageTimings

_STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class ModelStatistics:
    def __init__(self):
        self.totals = {stage: [0, 0] for stage in _STAGES}  # stage -> [count, nanoseconds]
        self.inference_count = 0  # rows answered (Triton counts batch items)
        self.execution_count = 0  # batches executed
        self.last_inference_ms = 0

    def _add(self, stage: str, seconds: float) -> None:
        t = self.totals[stage]
        t[0] += 1
        t[1] += int(seconds * 1e9)

    def answered(self, seconds: float, rows: int, timings: StageTimings | None = None,
                 respond_s: float = 0.0) -> None:
        """A request answered 200 after `seconds`, with its batch's stage times."""
        # inline, no call or list per stage: this runs for every answer
        totals = self.totals
        t = totals["success"]
        t[0] += 1
        t[1] += int(seconds * 1e9)
        t = totals["compute_output"]
        t[0] += 1
        t[1] += int(respond_s * 1e9)
        if timings is not None:
            t = totals["queue"]
            t[0] += 1
            t[1] += int(timings.queue_wait_s * 1e9)
            t = totals["compute_input"]
            t[0] += 1
            t[1] += int((timings.sample_s + timings.gather_s) * 1e9)
            t = totals["compute_infer"]
            t[0] += 1
            t[1] += int(timings.compute_s * 1e9)
        self.inference_count += rows
        self.last_inference_ms = int(time.time() * 1000)

    def answered_elsewhere(self, count: int, seconds: float, rows: int, respond_s: float) -> None:
        """`count` requests answered 200 by a front-end process itself (precomputed lookups),
        `seconds` and `respond_s` their sums: as answered() counts each, with stage times of
        zero for the stages a lookup has none of."""
        totals = self.totals
        for stage, ns in (("success", seconds), ("compute_output", respond_s), ("queue", 0.0), ("compute_input", 0.0),
                          ("compute_infer", 0.0)):
            t = totals[stage]
            t[0] += count
            t[1] += int(ns * 1e9)
        self.inference_count += rows
        self.last_inference_ms = int(time.time() * 1000)

    def failed(self, seconds: float) -> None:
        self._add("fail", seconds)
        self.last_inference_ms = int(time.time() * 1000)

    def executed(self) -> None:
        self.execution_count += 1

    def report(self, name: str, version: str) -> dict:
        """One entry of Triton's model_stats list."""
        return {"name": name, "version": version, "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {**{stage: {"count": c, "ns": ns} for stage, (c, ns) in self.totals.items()},
                                    "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0}},
                "batch_stats": []}
