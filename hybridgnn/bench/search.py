"""The SLO search of `hybridgnn bench --slo-ms`: the highest offered rate whose p99 stays
within an SLO with nothing refused or failed, found by open-loop loads (loadgen.run_load)
at doubling, then bisected rates, a line per trial on the log; a signal (stop) ends it
with the highest rate that held so far."""

from __future__ import annotations

import asyncio

from hybridgnn.bench import loadgen
from hybridgnn.bench.metadata import fetch_num_nodes


class _Stopped(Exception):
    """A search's trial was stopped by a signal (run_load's stop)."""


async def find_max_rate(url: str, model: str, *, slo_ms: float, duration_s: float, nodes_per_request: int,
                        start_rate: float = 100.0, max_rate: float = 1e6, binary: bool = True,
                        bisect_steps: int = 4, log=print, grpc_target: str | None = None,
                        make_bodies=None, node_type: str | None = None, seed: int = 0,
                        stop: asyncio.Future | None = None) -> tuple[float, loadgen.LoadResult | None]:
    """Highest offered rate whose p99 stays within slo_ms with nothing rejected or failed:
    double until the SLO breaks, then bisect. Returns (rate, result at that rate).
    make_bodies, node_type, seed: as run_load's (every trial draws with seed). stop: as
    run_load's; once done, the search ends with the highest rate that held so far."""
    num_nodes = await fetch_num_nodes(url, model, node_type) if make_bodies is None else None

    async def load(rate: float, duration_s: float) -> loadgen.LoadResult:
        res = await loadgen.run_load(url, model, rate=rate, duration_s=duration_s,
                                     nodes_per_request=nodes_per_request, binary=binary, num_nodes=num_nodes,
                                     grpc_target=grpc_target, make_bodies=make_bodies, node_type=node_type,
                                     seed=seed, stop=stop)
        if res.interrupted:
            log(f"  rate {rate:9.1f} req/s -> {res.interrupted} after {res.sent} requests: the search ends here")
            raise _Stopped
        return res

    async def trial(rate: float) -> loadgen.LoadResult:
        res = await load(rate, duration_s)
        log(f"  rate {rate:9.1f} req/s -> ok {res.achieved_rps:9.1f} req/s, p99 {res.p99_ms:8.2f} ms, "
            f"rejected {res.rejected}, errors {res.errors}"
            + (f" ({res.connect_errors} could not connect)" if res.connect_errors else "")
            + (f" [{loadgen.error_summary(res)}]" if loadgen.error_summary(res) else ""))
        return res

    def meets(res: loadgen.LoadResult) -> bool:
        return res.p99_ms <= slo_ms and res.rejected == 0 and res.errors == 0 and res.ok == res.sent

    async def holds(rate: float) -> loadgen.loadgen.LoadResult | None:
        """A rate holds if a trial meets the SLO; a failed trial is repeated once, so one
        stall on a shared machine does not end the search."""
        for _ in range(2):
            res = await trial(rate)
            if meets(res):
                return res
        return None

    good, good_res, bad = 0.0, None, None
    try:
        # Warm the server (compiled kernels, first-call allocations) outside the measurement.
        await load(start_rate, 1.0)
        rate = start_rate
        while rate <= max_rate:
            res = await holds(rate)
            if res is None:
                bad = rate
                break
            good, good_res = rate, res
            rate *= 2
        if bad is None:
            return good, good_res
        for _ in range(bisect_steps):
            mid = (good + bad) / 2 if good else bad / 2
            res = await holds(mid)
            if res is not None:
                good, good_res = mid, res
            else:
                bad = mid
    except _Stopped:  # the highest rate that held before the signal
        pass
    return good, good_res
