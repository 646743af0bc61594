"""Profiles and policies: load and check a profile (PSGS-latency curves per pipeline and
what they were measured on), its four operating points, the policy a name or an SLO
picks, and the --adapt re-fit. Decisions only; `hybridgnn profile` builds profiles.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridgnn.config import MAX_WORKERS
from hybridgnn.errors import ConfigError
from hybridgnn.scheduler.curves import (
    Curve,
    DeviceCurves,
    Samples,
    bin_statistics,
    choose_for_slo,
    operating_points,
)
from hybridgnn.scheduler.queueing import ServingLoad

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# The largest profile read: a 300 s profile of a fast GPU (about 600,000 raw batches) is
# some 30 MB of JSON, and parsing one takes about ten times its size in memory.
MAX_PROFILE_BYTES = 256 << 20
POLICIES = ("latency", "throughput", "cpu", "gpu")  # plus slo:<ms>


class ProfileMismatch(ConfigError):
    """A profile made for another dataset, model or fanouts."""


# The SLO choice simulates every worker (scheduler/simloops.py: a slot per worker, scanned
# per batch), so its time grows with them: 1,024 take ~6 s on two cores, a billion would
# allocate gigabytes and never finish. No machine profiles more (nor serves: the pipeline's bound).
MAX_PROFILE_WORKERS = MAX_WORKERS


def _whole(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"a profile's {name} must be a whole number in [{lo}, {hi}], got {value!r}")
    return value


def _positive(name: str, values) -> np.ndarray:
    """values (a number or a list of them) as floats, each finite and > 0; ValueError otherwise."""
    if isinstance(values, bool) or isinstance(values, (dict, str)):
        raise ValueError(f"a profile's {name} must be positive numbers, got {values!r}")
    try:
        out = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"a profile's {name} must be positive numbers, got {str(values)[:80]}") from None
    if out.ndim > 1 or not np.all(np.isfinite(out) & (out > 0)):
        raise ValueError(f"a profile's {name} must be finite positive numbers, got {str(values)[:80]}")
    return out


def _device_curves(p: dict) -> DeviceCurves:
    """A pipeline's curves with the cores its workers use (CPU-tensor pipelines only), its
    measured service spread (raw seconds ÷ the mean curve) and, for a split CPU lane, the
    device share of its batches (curves.device)."""
    mean, tail = Curve(**p["curves"]["mean"]), Curve(**p["curves"]["tail"])
    _whole("workers", p["workers"], 1, MAX_PROFILE_WORKERS)
    _whole("torch_threads", p.get("torch_threads", 1), 1, MAX_PROFILE_WORKERS)
    cores = p["workers"] * p.get("torch_threads", 1) if p.get("device", "cpu") == "cpu" else 0.0
    raw = p.get("raw") or {}
    ratios = None
    if raw.get("psgs"):
        try:
            x, y = np.asarray(raw["psgs"], dtype=np.float64), np.asarray(raw["seconds"], dtype=np.float64)
        except ValueError:  # numpy's "could not convert string to float" named no field
            raise ValueError(f"a profile's raw psgs and seconds must be numbers, got {str(raw)[:80]}") from None
        if x.shape != y.shape or x.ndim != 1:  # numpy's "could not be broadcast" named no field
            raise ValueError(f"a profile's raw psgs and seconds must be two lists of as many numbers, got "
                             f"{x.shape} and {y.shape}")
        r = y / np.maximum(mean(x), 1e-12)
        ratios = r[np.isfinite(r) & (r > 0)]
    share = p["curves"].get("device")
    return DeviceCurves(mean, tail, p["workers"], cores, ratios, shares_gil=not p.get("processes", False),
                        device_share=Curve(**share) if share else None)


def _curve_dict(c: Curve) -> dict:
    return {"psgs": c.psgs, "seconds": c.seconds}


@dataclass
class Policy:
    """What a profile and a policy set on a server."""

    name: str
    psgs_threshold: float
    max_batch_psgs: float
    pipeline_limits: dict[str, float]
    predicted_seeds_per_s: float | None
    predicted_p99_s: float | None


class Profile:
    def __init__(self, data: dict):
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"profile schema_version {data.get('schema_version')!r}; this build reads "
                             f"{SCHEMA_VERSION}")
        self.data = data
        if not data["pipelines"]:
            raise ValueError("the profile has no pipelines")
        self.devices = {name: _device_curves(p) for name, p in data["pipelines"].items()}
        # every value below is divided by or its logarithm taken: zero, negative and
        # non-finite ones are refused here, not met as a ZeroDivisionError or a NaN choice
        self.mean_seed_psgs = float(_positive("mean_seed_psgs", data["mean_seed_psgs"]))
        self.seed_psgs = _positive("seed_psgs_quantiles", data.get("seed_psgs_quantiles") or [self.mean_seed_psgs])
        edges = _positive("bin_edges", data["bin_edges"])
        if edges.size < 2 or np.any(edges[1:] <= edges[:-1]):
            raise ValueError(f"a profile's bin_edges must be at least two increasing numbers, got "
                             f"{str(data['bin_edges'])[:80]}")
        self.lo, self.hi = float(edges[0]), float(edges[-1])
        # what check_matches reads, read now: a profile lacking it is refused at load
        str(data["dataset"]["fingerprint"]), str(data["dataset"]["name"]), str(data["model"]["fingerprint"])
        list(data["fanouts"])

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """The profile at path; ValueError (one line) for what is not one. Only a regular
        file of at most MAX_PROFILE_BYTES is read: /dev/zero was read until memory ran out,
        and a FIFO no one writes to hung the server's start."""
        path = Path(path)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"no profile at {path}; make one with `hybridgnn profile`") from None
        except OSError as exc:
            raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISBLK(st.st_mode) \
                or stat.S_ISSOCK(st.st_mode):
            raise ValueError(f"profile {path} is not a regular file")
        if st.st_size > MAX_PROFILE_BYTES:
            raise ValueError(f"profile {path} holds {st.st_size:,} bytes, past the {MAX_PROFILE_BYTES:,} a "
                             "`hybridgnn profile` writes")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no profile at {path}; make one with `hybridgnn profile`") from None
        except OSError as exc:  # a directory, no permission, an I/O error
            raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"profile {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"profile {path} holds a JSON {type(data).__name__}, not a `hybridgnn profile` object")
        try:
            return cls(data)
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ValueError(f"profile {path} lacks a field this build needs, or has one of another type: "
                             f"{type(exc).__name__}: {exc}") from exc

    def save(self, path: str | Path) -> Path:
        """Written whole or not at all: a run killed mid-write (or out of disk) leaves the
        old profile, not a truncated one in its place."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.data, indent=1) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def check_matches(self, dataset_fingerprint: str, model_dir: Path, fanouts) -> None:
        """Refuse a profile made for another dataset, model or fanouts."""
        # here, not at the top: reading weights needs torch, which the --adapt helper
        # process (it imports this module to re-fit curves) has no use for
        from hybridgnn.models.checkpoint import weights_fingerprint, weights_match

        want = self.data
        problems = []
        if want["dataset"]["fingerprint"] != dataset_fingerprint:
            problems.append(f"dataset {want['dataset']['name']} ({want['dataset']['fingerprint']}), "
                            f"serving {dataset_fingerprint}")
        if not weights_match(want["model"]["fingerprint"], model_dir):
            problems.append(f"model weights {want['model']['fingerprint']}, serving {weights_fingerprint(model_dir)}")
        if list(want["fanouts"]) != list(fanouts):
            problems.append(f"fanouts {want['fanouts']}, serving {list(fanouts)}")
        if problems:
            raise ProfileMismatch("the profile was made for " + "; ".join(problems) +
                                  ". Profile this combination with `hybridgnn profile`")

    def refit(self, live: dict[str, tuple[np.ndarray, np.ndarray]], min_bin_samples: int = 20) -> Profile:
        """A copy whose curves use live (batch PSGS, seconds) samples in every bin that has
        at least min_bin_samples of them, and the profiled statistics elsewhere."""
        data = dict(self.data)
        data["pipelines"] = {}
        edges = np.asarray(self.data["bin_edges"])
        for name, pipe in self.data["pipelines"].items():
            bins = {k: list(v) for k, v in pipe["bins"].items()}
            if name in live and len(live[name][0]):
                x, y = live[name]
                stats = bin_statistics(Samples(list(x), list(y), [0] * len(x)), edges)
                for i, c in enumerate(stats["count"]):
                    if c < min_bin_samples:
                        continue
                    # replace the profiled bin with the same centre bin, or add it
                    which = int(np.clip(np.searchsorted(edges, stats["psgs"][i], side="right") - 1, 0, len(edges) - 2))
                    known = [int(np.clip(np.searchsorted(edges, p, side="right") - 1, 0, len(edges) - 2))
                             for p in bins["psgs"]]
                    j = known.index(which) if which in known else None
                    row = {k: stats[k][i] for k in ("psgs", "count", "mean_s", "tail_s")}
                    if j is None:
                        j = int(np.searchsorted(bins["psgs"], row["psgs"]))
                        for k in row:
                            bins[k].insert(j, row[k])
                    else:
                        for k in row:
                            bins[k][j] = row[k]
            curves = {"mean": _curve_dict(Curve.fit(bins["psgs"], bins["mean_s"], bins["count"])),
                      "tail": _curve_dict(Curve.fit(bins["psgs"], bins["tail_s"], bins["count"]))}
            if "device" in pipe["curves"]:  # a split lane's device share, as profiled
                curves["device"] = pipe["curves"]["device"]
            data["pipelines"][name] = dict(pipe, bins=bins, curves=curves)
        out = Profile(data)
        out.devices = {n: d for n, d in out.devices.items() if n in self.devices}
        return out

    def points(self):
        return operating_points(self.devices["cpu"], self.devices["gpu"], self.lo, self.hi, self.mean_seed_psgs)

    def policy(self, spec: str, *, batching_wait_s: float = 0.0, load: ServingLoad | None = None) -> Policy:
        """latency | throughput | cpu | gpu (an operating point; cpu/gpu are the CPU- and
        GPU-preferred points), slo:<ms>, or slo-mean:<ms> (the same from the mean curve).
        load: the traffic and front-end cost an SLO choice assumes (ServingLoad defaults)."""
        if spec.startswith("slo:") or spec.startswith("slo-mean:"):
            prefix, _, value = spec.partition(":")
            try:
                slo_ms = float(value)
            except ValueError:
                raise ValueError(f"policy {spec!r}: expected slo:<milliseconds>, e.g. slo:20") from None
            if not 0 < slo_ms < math.inf:  # slo:inf simulated nothing and said "min() arg is an empty sequence"
                raise ValueError(f"policy {spec!r}: the SLO must be a positive, finite number of milliseconds")
            # slo-mean bounds batches by the mean curve (Quiver's "PSGS-loose"), for comparison
            c = choose_for_slo(self.devices, slo_ms / 1e3, self.seed_psgs, batching_wait_s=batching_wait_s,
                               lo=self.lo, hi=self.hi, tail=prefix == "slo", load=load)
            return Policy(spec, c.psgs_threshold, c.max_batch_psgs, c.pipeline_limits, c.predicted_seeds_per_s,
                          c.predicted_p99_s)
        if spec not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, slo:<ms> or slo-mean:<ms>, "
                             f"got {spec!r}")
        if set(self.devices) != {"cpu", "gpu"}:
            raise ValueError(f"policy {spec!r} picks a point between the CPU and GPU pipelines, but only "
                             f"{sorted(self.devices)} is served: give --policy slo:<ms> (e.g. slo:50)")
        key = {"latency": "latency_preferred", "throughput": "throughput_preferred",
               "cpu": "cpu_preferred", "gpu": "gpu_preferred"}[spec]
        p = self.points()[key]
        return Policy(spec, p.psgs_threshold, math.inf, {}, p.predicted_seeds_per_s, None)


def adapted_policy(data: dict, pipelines: list[str], live: dict[str, tuple[np.ndarray, np.ndarray]], spec: str,
                   batching_wait_s: float, load: ServingLoad, min_bin_samples: int = 20) -> Policy:
    """The policy a profile gives once live samples replace its bins (`serve --adapt`).
    A plain function of plain data, so the server can run it in a helper process: an SLO
    choice simulates serving for about a second, which must not hold the event loop."""
    prof = Profile(data)
    prof.devices = {n: d for n, d in prof.devices.items() if n in pipelines}
    return prof.refit(live, min_bin_samples).policy(spec, batching_wait_s=batching_wait_s, load=load)
