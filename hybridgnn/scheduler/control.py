"""The policy in force and its --adapt control (decisions only: the engine applies them).

Holds the profile a server was started with, the policy (PSGS threshold, batch PSGS
bound, per-pipeline limits) and the recent (batch PSGS, service seconds) of each
pipeline; re-fits the profile's curves with them on --adapt and proposes a bounded step
towards the new choice.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time

import numpy as np

from hybridgnn.config import PolicyConfig, ServeConfig
from hybridgnn.errors import ConfigError
from hybridgnn.scheduler.policy import Policy, Profile, ProfileMismatch, adapted_policy
from hybridgnn.scheduler.queueing import ServingLoad

log = logging.getLogger(__name__)


class PolicyControl:
    def __init__(self, cfg: ServeConfig, pipelines: tuple[str, ...]):
        self.cfg = cfg
        self.pipelines = pipelines
        self.profile: Profile | None = None
        self.policy: Policy | None = None  # what is in force; the engine sets it
        # (batch PSGS, service seconds) of recent batches per pipeline, as they ran
        self.recent: dict[str, collections.deque] = {n: collections.deque(maxlen=5000) for n in pipelines}
        # for --adapt: those since the last step, then (once a step knows the request rate
        # they ran at) with that window's front-end stretch divided out
        self._unscaled: dict[str, collections.deque] = {n: collections.deque(maxlen=5000) for n in pipelines}
        self._scaled: dict[str, collections.deque] = {n: collections.deque(maxlen=5000) for n in pipelines}
        self.admitted = (0, 0)  # requests, seeds since start
        self._adapt_mark = (time.perf_counter(), 0, 0)

    def record(self, pipeline: str, psgs: float, seconds: float) -> None:
        """A batch of `pipeline` served: its PSGS and service seconds."""
        self.recent[pipeline].append((psgs, seconds))
        self._unscaled[pipeline].append((psgs, seconds))

    def count_admitted(self, seeds: int) -> int:
        """Count one admitted request of `seeds` seeds; returns the requests before it."""
        requests, total = self.admitted
        self.admitted = (requests + 1, total + seeds)
        return requests

    def load(self, graph_fingerprint: str) -> Policy:
        """Check the profile fits what is served and return the policy it gives."""
        pc = self.cfg.policy
        try:
            prof = Profile.load(pc.profile)
            prof.check_matches(graph_fingerprint, self.cfg.model_dir, self.cfg.sampling.fanouts)
        except (ProfileMismatch, ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"profile {pc.profile}: {exc}") from exc
        missing = sorted(set(self.pipelines) - set(prof.devices))
        if missing:
            raise ConfigError(f"profile {pc.profile} has no curves for the {', '.join(missing)} pipeline; profile "
                              "with the same --device as you serve with")
        prof.devices = {n: d for n, d in prof.devices.items() if n in self.pipelines}
        differ = self.profiled_otherwise(prof)
        if differ:
            log.warning("profile %s measured other pipelines than these serve (%s): its curves, predicted rates and "
                        "an slo:<ms> choice are for those; profile with the pipeline flags you serve with",
                        pc.profile, "; ".join(differ))
        if pc.adapt:
            # what every --adapt step re-fits from: refused now in one line, not met as a
            # traceback logged every adapt_interval_s while the policy never moves
            try:
                prof.refit({})
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                raise ConfigError(f"profile {pc.profile} cannot be re-fitted for --adapt: its per-bin statistics "
                                  f"(pipelines.*.bins) are missing or malformed: {type(exc).__name__}: "
                                  f"{str(exc)[:200]}") from exc
        try:
            policy = prof.policy(pc.policy, batching_wait_s=self.cfg.batcher.max_wait_s,
                                 load=ServingLoad.from_policy(pc, batcher=self.cfg.batcher))
        except ValueError as exc:
            # each of policy()'s messages names the policy: name it once, and say when it is the default
            said, named = str(exc), f"policy {pc.policy!r}"
            if named not in said:
                said = f"{named}: {said}"
            if pc.policy == PolicyConfig.policy:
                said = said.replace(named, f"{named} (the default)", 1)
            raise ConfigError(f"profile {pc.profile}: {said}") from exc
        self.profile = prof
        log.info("policy %s from %s: PSGS threshold %s, batch PSGS up to %s, predicted %s seeds/s", policy.name,
                 pc.profile, policy.psgs_threshold, policy.max_batch_psgs,
                 f"{policy.predicted_seeds_per_s:.0f}" if policy.predicted_seeds_per_s else "?")
        return policy

    def profiled_otherwise(self, prof: Profile) -> list[str]:
        """How the served pipelines differ from those the profile measured (workers,
        threads, processes, split lane, device): the curves, and the workers the SLO choice
        simulates, are the profile's, so a profile made with --workers 16 served with 2
        predicted 8x the rate it gets."""
        out = []
        for pipe in (self.cfg.cpu_pipeline, self.cfg.gpu_pipeline):
            if pipe is None or pipe.name not in prof.devices:
                continue
            had = prof.data["pipelines"][pipe.name]
            for key, served in (("workers", pipe.workers), ("torch_threads", pipe.torch_threads),
                                ("processes", pipe.processes), ("split", pipe.split), ("device", pipe.device)):
                profiled = had.get(key, {"torch_threads": 1, "processes": False, "split": False}.get(key))
                if profiled != served:
                    out.append(f"{pipe.name} {key} {profiled!r}, serving {served!r}")
        return out

    def service_stretch(self, last: int = 500) -> dict[str, float] | None:
        """Per pipeline, the median of (live batch service time ÷ the profile's mean at that
        batch PSGS) over the last batches, over the same median for the profiled batches:
        how much slower than profiled batches run now (the event loop's share of the GIL and
        cores, other load, drift). None without a profile."""
        if self.profile is None:
            return None
        out = {}
        for name, d in self.recent.items():
            if name not in self.profile.devices or not d:
                continue
            tail = list(d)[-last:]
            psgs = np.array([p for p, _ in tail])
            seconds = np.array([s for _, s in tail])
            dev = self.profile.devices[name]
            live = float(np.median(seconds / np.maximum(dev.mean(psgs), 1e-12)))
            out[name] = round(live / float(np.median(dev.service_ratios())), 4)  # like for like: both medians
        return out

    def adapt_inputs(self) -> tuple | None:
        """What an --adapt step re-fits from: (profile data, pipelines, live samples, policy,
        batching wait, serving load), or None while too few batches are recorded or no
        request was admitted since the last step. Live service times are divided by the
        front-end stretch at the request rate of the window they ran in (each window's
        batches by its own: a busy window's were slower for it), so the choice, which
        applies the stretch again at the rates it tries, counts it once; seeds per request
        become the recent mean."""
        pc = self.cfg.policy
        now = time.perf_counter()
        requests, seeds = self.admitted
        last_t, last_requests, last_seeds = self._adapt_mark
        self._adapt_mark = (now, requests, seeds)
        window_requests = requests - last_requests
        if self.profile is None or not window_requests:
            # No traffic since the last step: no batch is new (one still finishing waits for
            # the next window), and the policy would move on no news (the re-fit costs a
            # core-second)
            return None
        rps = window_requests / max(now - last_t, 1e-9)
        # at least one seed a request (the load's own bound): requests that count no seeds
        # (new nodes) among them made the mean refused, which ended the adapt loop
        mean = (seeds - last_seeds) / window_requests
        load = ServingLoad.from_policy(pc, max(1.0, mean) if mean > 0 else None, self.cfg.batcher)
        for name, fresh in self._unscaled.items():
            if name not in self.profile.devices or not fresh:
                continue
            stretch = self.profile.devices[name].model().stretch(rps, load)
            stretch = stretch if math.isfinite(stretch) and stretch > 0 else 1.0
            self._scaled[name].extend((p, s / stretch) for p, s in fresh)
            fresh.clear()
        live = {n: d for n, d in self._scaled.items() if len(d) >= pc.adapt_min_batches}
        if not live:
            return None
        samples = {name: (np.array([p for p, _ in d]), np.array([s for _, s in d])) for name, d in live.items()}
        # live service times already carry any drift: no --service-scale on top of them
        load = dataclasses.replace(load, service_scale=1.0)
        return self.profile.data, sorted(self.profile.devices), samples, pc.policy, self.cfg.batcher.max_wait_s, load

    def adapt_once(self) -> Policy | None:
        """Re-fit the profile's curves with recent batches and return a step towards the
        new choice (at most a factor of adapt_max_step), or None to keep the current one."""
        inputs = self.adapt_inputs()
        if inputs is None:
            return None
        try:
            target = adapted_policy(*inputs)
        except ValueError as exc:
            log.warning("adapt: no policy fits the recent batches (%s); keeping the current one", exc)
            return None
        return self.step_towards(target)

    def step_towards(self, target: Policy) -> Policy | None:
        """The current policy moved towards target, bounded; None if it would barely move.
        Each value (threshold, batch bound, each pipeline's batch bound) moves towards its target by at most a factor of adapt_max_step, never
        to NaN or a negative value, and never from a finite value to inf (all on the CPU)
        or 0 (all on the GPU). A value at inf or 0 (where the profile put it) steps from the
        largest or smallest PSGS the profile measured, which routes every batch it saw alike."""
        pc = self.cfg.policy
        old = self.policy
        lo, hi = (self.profile.lo, self.profile.hi) if self.profile is not None else (1.0, 1.0)

        def bounded(new: float, cur: float) -> float:
            if math.isnan(new) or new < 0:
                return cur
            if new == cur:
                return new
            # a factor on 0 or inf goes nowhere or anywhere: step from the edge it stands for
            ref = cur if 0 < cur < math.inf else (hi if cur == math.inf else lo)
            stepped = min(max(new, ref / pc.adapt_max_step), ref * pc.adapt_max_step)
            return max(stepped, new) if cur > new else min(stepped, new)  # never past the target

        # each pipeline's batch bound too: it jumped to the target's whatever the step
        limits = {name: bounded(new, old.pipeline_limits.get(name, new))
                  for name, new in target.pipeline_limits.items()}
        step = dataclasses.replace(target, psgs_threshold=bounded(target.psgs_threshold, old.psgs_threshold),
                                   max_batch_psgs=bounded(target.max_batch_psgs, old.max_batch_psgs),
                                   pipeline_limits=limits)

        def moved(a: float, b: float) -> bool:
            return (math.isfinite(a) != math.isfinite(b)) or (math.isfinite(a) and abs(a - b) > 0.05 * max(abs(b), 1))

        if not (moved(step.psgs_threshold, old.psgs_threshold) or moved(step.max_batch_psgs, old.max_batch_psgs)
                or any(moved(v, old.pipeline_limits.get(n, v)) for n, v in limits.items())):
            return None
        log.info("adapt: PSGS threshold %.6g -> %.6g, batch PSGS bound %.6g -> %.6g (from %s recent batches)",
                 old.psgs_threshold, step.psgs_threshold, old.max_batch_psgs, step.max_batch_psgs,
                 {n: len(v) for n, v in self.recent.items()})
        return step

    async def adapt_loop(self, apply) -> None:
        """Every adapt_interval_s, re-fit and apply(step) when the policy should move."""
        # The choice runs in a helper process: it simulates serving for about a second,
        # which on this process would hold the GIL the event loop and workers need.
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            while True:
                await asyncio.sleep(self.cfg.policy.adapt_interval_s)
                try:  # inside: a failure here ended the loop, unlogged, and the policy never moved again
                    inputs = self.adapt_inputs()
                    if inputs is None:
                        continue
                    target = await asyncio.get_running_loop().run_in_executor(pool, adapted_policy, *inputs)
                except ValueError as exc:
                    log.warning("adapt: no policy fits the recent batches (%s); keeping the current one", exc)
                    continue
                except Exception:
                    log.exception("adapt: re-fit failed; keeping the current policy")
                    continue
                step = self.step_towards(target)
                if step is not None:
                    apply(step)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def prediction_assumes(self) -> dict | None:
        """What predicted_seeds_per_s assumes, in the words of the flags that set it."""
        if self.policy is None:
            return None
        pc = self.cfg.policy
        if not self.policy.name.startswith("slo"):
            return {"what": "capacity of the profiled pipelines with batches at the policy's threshold, all "
                            "workers busy; no front end, no queueing: an upper bound, not a served rate"}
        return {"what": "highest rate whose simulated p99 fits the SLO: Poisson arrivals through the batcher "
                        "and the profiled workers, the event loop as a queue of its own",
                "request_seeds": pc.request_seeds, "frontend_cpu_us": pc.frontend_cpu_us,
                "colocated_cpu_us": pc.colocated_cpu_us, "service_scale": pc.service_scale,
                "batching_wait_ms": self.cfg.batcher.max_wait_s * 1e3}
