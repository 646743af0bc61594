"""Latency-vs-PSGS curves, their crossing points, and SLO-bound operating points
(Quiver §4.2, docs/architecture.md).

A Curve is piecewise linear in log(PSGS) through per-bin statistics made monotone
non-decreasing by pool-adjacent-violators (weighted by samples per bin): a bigger batch
never predicts a lower latency. Beyond the measured range latency grows in proportion
to PSGS from the last knot (sampling cost tracks PSGS), and below it stays at the first.

The four points compare two devices' curves (CPU first):
    cpu_preferred         CPU tail = GPU mean
    gpu_preferred         CPU mean = GPU tail
    latency_preferred     CPU tail = GPU tail
    throughput_preferred  CPU mean = GPU mean
Each is the PSGS threshold where the two sides meet: batches below go to the CPU.
Where the curves do not cross in the measured range, one device dominates and the
threshold is +inf (CPU always at least as good) or 0 (GPU always better).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

POINTS = {
    "cpu_preferred": ("tail", "mean"),
    "gpu_preferred": ("mean", "tail"),
    "latency_preferred": ("tail", "tail"),
    "throughput_preferred": ("mean", "mean"),
}


def isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    means, sizes, counts = [], [], []
    for v, w in zip(np.asarray(values, float), np.asarray(weights, float), strict=True):
        means.append(v)
        sizes.append(w)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            w2 = sizes[-2] + sizes[-1]
            means[-2] = (means[-2] * sizes[-2] + means[-1] * sizes[-1]) / w2 if w2 > 0 else means[-1]
            sizes[-2] = w2
            counts[-2] += counts[-1]
            del means[-1], sizes[-1], counts[-1]
    return np.repeat(means, counts)


@dataclass
class Curve:
    """Latency (seconds) against batch PSGS for one device and one statistic."""

    psgs: list[float]  # knots, increasing
    seconds: list[float]

    def __post_init__(self):
        if len(self.psgs) == 0 or len(self.psgs) != len(self.seconds):
            raise ValueError("a curve needs as many latencies as PSGS knots, and at least one")
        # as floats: a JSON integer past int64 (10**30 seconds) made an object array that
        # np.interp refused with a TypeError when the policy was chosen
        try:
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (*self.psgs, *self.seconds)):
                raise TypeError
            self.psgs, self.seconds = [float(v) for v in self.psgs], [float(v) for v in self.seconds]
        except (TypeError, OverflowError):
            raise ValueError(f"a curve's PSGS knots and latencies must be numbers, got knots {str(self.psgs)[:80]} "
                             f"and seconds {str(self.seconds)[:80]}") from None
        if any(b <= a for a, b in zip(self.psgs, self.psgs[1:], strict=False)):
            raise ValueError("curve knots must increase")
        # a NaN knot or latency makes every comparison false (a threshold from nothing), an
        # infinite one no crossing, a zero latency an infinite batch bound (and a division
        # by zero in the simulator): a profile holding one is refused at load, not served
        if not all(math.isfinite(v) and v > 0 for v in (*self.psgs, *self.seconds)):
            raise ValueError(f"a curve's PSGS knots and latencies must be finite and positive, got knots "
                             f"{list(self.psgs)} and seconds {list(self.seconds)}")

    def __call__(self, psgs) -> np.ndarray:
        x = np.maximum(np.asarray(psgs, dtype=float), 1e-9)
        kx, ky = np.log(np.asarray(self.psgs)), np.asarray(self.seconds)
        y = np.interp(np.log(x), kx, ky)
        beyond = x > self.psgs[-1]
        return np.where(beyond, ky[-1] * x / self.psgs[-1], y)

    def max_psgs_within(self, seconds: float) -> float:
        """Largest PSGS whose predicted latency is within `seconds` (0 if none is), on the
        curve's rising envelope: a hand-written curve that falls somewhere (fitted ones
        never do) is read as the slowest it has been up to each knot, never past a knot
        it exceeds."""
        ky = np.maximum.accumulate(np.asarray(self.seconds, dtype=float))
        if ky[0] > seconds:
            return 0.0
        if ky[-1] <= seconds:
            return self.psgs[-1] * seconds / ky[-1]  # proportional growth beyond the range
        i = int(np.searchsorted(ky, seconds, side="right"))  # first knot above
        lo, hi = math.log(self.psgs[i - 1]), math.log(self.psgs[i])
        if ky[i] == ky[i - 1]:
            return self.psgs[i - 1]
        frac = (seconds - ky[i - 1]) / (ky[i] - ky[i - 1])
        return float(math.exp(lo + frac * (hi - lo)))

    @classmethod
    def fit(cls, bin_psgs, bin_seconds, bin_counts) -> Curve:
        keep = np.asarray(bin_counts) > 0
        x = np.asarray(bin_psgs, float)[keep]
        y = isotonic(np.asarray(bin_seconds, float)[keep], np.asarray(bin_counts, float)[keep])
        return cls([float(v) for v in x], [float(v) for v in y])


@dataclass
class DeviceCurves:
    """A pipeline's curves, its workers, the cores those workers keep busy (0 for a device
    pipeline, whose work the front end's CPU use does not slow) and its measured service
    spread: raw seconds ÷ the mean curve at the batch's PSGS (None: derived from the curves)."""

    mean: Curve
    tail: Curve
    workers: int
    cores_used: float = 0.0
    ratios: np.ndarray | None = None
    shares_gil: bool = True  # False: the workers run in processes of their own
    # A split CPU lane (Quiver's): the mean seconds of each batch's device share (gather and
    # model on the GPU it shares with the GPU lane); the rest is its host share (sampling)
    device_share: Curve | None = None

    def get(self, which: str) -> Curve:
        return self.mean if which == "mean" else self.tail

    def service_ratios(self, n: int = 512) -> np.ndarray:
        """Service time ÷ mean: the measured ratios, else a log-normal whose 99th
        percentile is the tail curve's ratio to the mean at the middle knot."""
        if self.ratios is not None and len(self.ratios):
            return np.asarray(self.ratios, dtype=np.float64)
        mid = self.mean.psgs[len(self.mean.psgs) // 2]
        spread = max(float(self.tail(mid)) / max(float(self.mean(mid)), 1e-12), 1.0)
        sigma = math.log(spread) / 2.326
        z = np.random.default_rng(0).standard_normal(n)
        return np.exp(sigma * z - sigma**2 / 2)

    def model(self, tail: bool = True):
        from hybridgnn.scheduler.queueing import PipelineModel

        ratios = self.service_ratios() if tail else np.ones(1)
        return PipelineModel(self.mean.psgs, self.mean.seconds, ratios, self.workers, self.cores_used,
                             shares_gil=self.shares_gil)

    def split_models(self, tail: bool = True):
        """(host share, device share) of a split CPU lane as simulator pipelines: the device
        share is its measured curve, the host share the mean curve less it (at least 1 %
        of the mean: sampling never costs nothing)."""
        from hybridgnn.scheduler.queueing import PipelineModel

        if self.device_share is None:
            raise ValueError("not a split lane: no device-share curve")
        ratios = self.service_ratios() if tail else np.ones(1)
        knots = np.asarray(self.mean.psgs)
        mean = np.asarray(self.mean.seconds)
        host = np.maximum(mean - np.minimum(self.device_share(knots), mean), 0.01 * mean)
        return (PipelineModel(knots, host, ratios, self.workers, self.cores_used, shares_gil=self.shares_gil),
                PipelineModel(self.device_share.psgs, self.device_share.seconds, ratios, 1, 0.0))


@dataclass
class OperatingPoint:
    name: str
    psgs_threshold: float  # +inf: all on CPU; 0: all on GPU
    # "crossed", "cpu_dominates", "gpu_dominates" or "inverted" (the GPU lower at small PSGS,
    # the CPU at large: one threshold, CPU below and GPU above, cannot route that)
    crossing: str
    predicted_seeds_per_s: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["psgs_threshold"] = "inf" if math.isinf(self.psgs_threshold) else self.psgs_threshold
        return d


def crossing(cpu: Curve, gpu: Curve, lo: float, hi: float, grid: int = 400) -> tuple[float, str]:
    """Where cpu(x) - gpu(x) turns from <= 0 to > 0 over [lo, hi] (log grid, then
    bisection): the PSGS above which the GPU side is lower. No sign change: the device
    lower over the whole range dominates. The GPU lower at lo but not everywhere:
    (0.0, "inverted")."""
    xs = np.exp(np.linspace(math.log(lo), math.log(hi), grid))
    diff = cpu(xs) - gpu(xs)
    above = diff > 0
    if not above.any():
        return math.inf, "cpu_dominates"
    first = int(np.argmax(above))
    if first == 0:
        return 0.0, "gpu_dominates" if above.all() else "inverted"
    a, b = xs[first - 1], xs[first]
    for _ in range(60):
        mid = math.sqrt(a * b)
        if float(cpu(mid) - gpu(mid)) > 0:
            b = mid
        else:
            a = mid
    return float(b), "crossed"


def capacity(curves: DeviceCurves, psgs: float, mean_seed_psgs: float) -> float:
    """Seeds/s one device sustains when all its workers run batches of this PSGS; a split
    lane at most what its one device stage finishes (one batch per device share)."""
    if psgs <= 0 or not math.isfinite(psgs):
        return 0.0
    batches = curves.workers / max(float(curves.mean(psgs)), 1e-9)
    if curves.device_share is not None:
        batches = min(batches, 1.0 / max(float(curves.device_share(psgs)), 1e-9))
    return batches * psgs / mean_seed_psgs


def operating_points(cpu: DeviceCurves, gpu: DeviceCurves, lo: float, hi: float,
                     mean_seed_psgs: float) -> dict[str, OperatingPoint]:
    """The four points, each with the throughput predicted when both devices run batches
    at the threshold's PSGS (the batch size a saturated server reaches there); a
    dominating device is credited alone at the largest measured PSGS, and so is the one of
    inverted curves that sustains more there (it takes every batch)."""
    out = {}
    for name, (cpu_stat, gpu_stat) in POINTS.items():
        thr, kind = crossing(cpu.get(cpu_stat), gpu.get(gpu_stat), lo, hi)
        if kind == "crossed":
            seeds = capacity(cpu, thr, mean_seed_psgs) + capacity(gpu, thr, mean_seed_psgs)
        elif kind == "inverted":
            on_cpu, on_gpu = capacity(cpu, hi, mean_seed_psgs), capacity(gpu, hi, mean_seed_psgs)
            thr, seeds = (math.inf, on_cpu) if on_cpu > on_gpu else (0.0, on_gpu)
        else:
            seeds = capacity(cpu if kind == "cpu_dominates" else gpu, hi, mean_seed_psgs)
        out[name] = OperatingPoint(name, thr, kind, seeds)
    return out


@dataclass
class SLOChoice:
    """What slo:<ms> sets: the routing threshold, the largest batch PSGS the batcher forms,
    and which devices may take a batch of that size within the SLO."""

    slo_s: float
    psgs_threshold: float
    max_batch_psgs: float
    pipeline_limits: dict[str, float]  # largest batch PSGS each pipeline takes
    predicted_seeds_per_s: float  # the highest load whose simulated p99 fits the SLO
    predicted_p99_s: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["psgs_threshold"] = "inf" if math.isinf(self.psgs_threshold) else self.psgs_threshold
        return d


def choose_for_slo(devices: dict[str, DeviceCurves], slo_s: float, seed_psgs, *,
                   batching_wait_s: float = 0.0, lo: float = 1.0, hi: float = 1e7, tail: bool = True,
                   load=None) -> SLOChoice:
    """Per device, the batch PSGS bound that maximises the request rate whose p99 stays
    within the SLO under open-loop Poisson load, found by simulating the batcher and the
    workers (scheduler/queueing.py) with service times from the profile: the mean curve
    times the measured spread (tail=True, "PSGS-strict"), or the mean curve alone
    (tail=False, Quiver's "PSGS-loose"). The front end's CPU per request slows CPU
    pipelines as load grows (`load`, a ServingLoad). Device pipelines are chosen first;
    CPU pipelines are then charged the front-end cost of every request, theirs and the
    devices'. The CPU takes batches up to the latency-preferred crossing (or its own bound,
    if lower), the GPU the rest; the batcher forms batches up to the largest bound. A split
    CPU lane (its curves carry a device share) shares the GPU with the GPU lane: their rates
    are then chosen together on one simulated device (_shared_rates).
    seed_psgs: per-seed PSGS values requests are drawn from (a float: all seeds alike)."""
    from hybridgnn.scheduler.queueing import ServingLoad, Simulator, best_bound

    load = load or ServingLoad()
    seed_psgs = np.atleast_1d(np.asarray(seed_psgs, dtype=np.float64))
    if slo_s <= batching_wait_s:
        raise ValueError(f"an SLO of {slo_s * 1e3:.4g} ms leaves nothing after {batching_wait_s * 1e3:.4g} ms "
                         "of batching wait")
    stat = "tail" if tail else "mean"
    limits: dict[str, float] = {}
    rates: dict[str, float] = {}
    p99s: dict[str, float] = {}
    other_rps = 0.0
    for name in sorted(devices, key=lambda n: devices[n].cores_used > 0):  # device pipelines first
        d = devices[name]
        ceiling = d.get(stat).max_psgs_within(slo_s - batching_wait_s - load.frontend_cpu_s)
        if ceiling <= 0:
            continue
        sim = Simulator(d.model(tail), seed_psgs, load, batching_wait_s=batching_wait_s, background_rps=other_rps)
        floor = min(sim.mean_request_psgs, ceiling)
        choice = best_bound(sim, slo_s, floor, ceiling)
        if choice.requests_per_s <= 0:
            continue
        limits[name], rates[name], p99s[name] = choice.bound, choice.requests_per_s, choice.p99_s
        other_rps += choice.requests_per_s
    if not limits:
        fastest = min(devices, key=lambda n: float(devices[n].get(stat)(lo)))
        raise ValueError(f"no batch meets a p99 of {slo_s * 1e3:.4g} ms on any device (the smallest measured "
                         f"batch takes {float(devices[fastest].get(stat)(lo)) * 1e3:.1f} ms on {fastest}, and "
                         "requests queue behind one another)")
    for name in devices:
        limits.setdefault(name, 0.0)
    alone = (dict(rates), dict(p99s))  # each device's choice before the shared one
    if devices.get("cpu") is not None and devices["cpu"].device_share is not None and "gpu" in devices:
        # the split CPU lane's device share runs on the GPU the GPU lane uses: one server
        # (and one stage for its workers, when the GPU lane takes nothing)
        rates, p99s = _shared_rates(devices, slo_s, seed_psgs, limits, rates, batching_wait_s, load, tail)
        if not sum(rates.values()) > 0:  # else a choice of 0 seeds/s "at a p99 of 0" would be served
            raise ValueError(f"no load meets a p99 of {slo_s * 1e3:.4g} ms once the split CPU lane's device share "
                             "queues on the GPU (the GPU lane fits nothing alone, and the CPU lane's batches "
                             "miss the SLO there)")
    max_batch = max(limits.values())
    if set(devices) == {"cpu", "gpu"}:
        cross, _ = crossing(devices["cpu"].tail, devices["gpu"].tail, lo, hi)
        threshold = min(cross, limits["cpu"]) if limits["cpu"] > 0 else 0.0
        if limits["gpu"] <= 0:
            threshold = math.inf
        if threshold == 0 and "gpu" in alone[0]:
            # the router sends the CPU only what spills from a saturated GPU: the GPU serves
            # what it fits alone (a shared choice may have split the load otherwise)
            rates, p99s = {"gpu": alone[0]["gpu"]}, {"gpu": alone[1]["gpu"]}
    else:
        threshold = math.inf if "cpu" in devices else 0.0
    seeds = sum(rates.values()) * max(1, round(load.request_seeds))
    return SLOChoice(slo_s, threshold, max_batch, limits, seeds, max(p99s.values()))


def _shared_rates(devices, slo_s: float, seed_psgs, limits: dict, rates: dict, batching_wait_s: float, load,
                  tail: bool, steps: int = 21):
    """Rates of both lanes on one GPU (scheduler/queueing.SharedDeviceSimulator): the GPU
    lane at a share f of the rate it fits alone, the CPU lane at the most that then fits
    with both lanes' p99 within the SLO; the f whose total is largest (ties: more on the
    GPU). f runs down from 1 in steps, with 0.99 and 0.98 beside: the GPU lane's own rate
    leaves only its headroom, so the CPU lane's room opens just below it. Returns (rates,
    p99s)."""
    from hybridgnn.scheduler.queueing import SharedDeviceSimulator

    host, device = devices["cpu"].split_models(tail)
    sim = SharedDeviceSimulator(host, device, devices["gpu"].model(tail), seed_psgs, load,
                                batching_wait_s=batching_wait_s)
    gpu_alone = rates.get("gpu", 0.0)
    hi = max(rates.get("cpu", 0.0), gpu_alone, 1.0) * 2
    best = (-1.0, 0.0, 0.0, math.inf)
    for f in np.unique(np.concatenate([np.linspace(0.0, 1.0, steps), [0.98, 0.99]]))[::-1]:
        r_gpu = float(f) * gpu_alone
        r_cpu, p99 = sim.max_cpu_rate(slo_s, max(limits["cpu"], 1e-9), r_gpu, limits["gpu"], hi)
        if p99 > slo_s:
            continue  # the GPU lane alone at this rate already misses it (on the shared device's draws)
        if limits["cpu"] <= 0:
            r_cpu = 0.0
        if r_gpu + r_cpu > best[0] * (1 + 1e-6):
            best = (r_gpu + r_cpu, r_gpu, r_cpu, p99)
    _, r_gpu, r_cpu, p99 = best
    if not math.isfinite(p99):  # nothing fits together (f = 0 always fits unless the CPU lane cannot)
        return {"gpu": 0.0, "cpu": 0.0}, {"gpu": math.inf, "cpu": math.inf}
    return {"gpu": r_gpu, "cpu": r_cpu}, {"gpu": p99, "cpu": p99}


@dataclass
class Samples:
    psgs: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    device: list[float] = field(default_factory=list)  # per batch, where run_batch returned stage times

    def add(self, psgs: float, seconds: float, seeds: int) -> None:
        self.psgs.append(psgs)
        self.seconds.append(seconds)
        self.seeds.append(seeds)


def bin_statistics(samples: Samples, edges: np.ndarray, quantile: float = 0.99) -> dict:
    """Per bin: geometric-centre PSGS, count, mean and tail latency (seconds)."""
    x, y = np.asarray(samples.psgs), np.asarray(samples.seconds)
    which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    out = {"psgs": [], "count": [], "mean_s": [], "tail_s": []}
    for b in range(len(edges) - 1):
        sel = which == b
        if not sel.any():
            continue
        out["psgs"].append(float(np.exp(np.mean(np.log(np.maximum(x[sel], 1e-9))))))
        out["count"].append(int(sel.sum()))
        out["mean_s"].append(float(y[sel].mean()))
        out["tail_s"].append(float(np.quantile(y[sel], quantile)))
    return out
