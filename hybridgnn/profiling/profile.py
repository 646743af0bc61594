"""Build a profile: PSGS–latency curves per pipeline, the four operating points, and
what the hardware, dataset, model and fanouts were (scheduler/policy.py loads, checks
and chooses from it).

The pipelines profiled are the serving engine's own executors (built from the same
ServeConfig as `hybridgnn serve`), so a profile measures exactly what will serve. A split
CPU lane also records the device's share of its batches, which an SLO choice queues on
the GPU with the GPU lane's (or, with --other-lane-loaded, each lane is profiled beside
the other's device work instead: other_lane_busy).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from hybridgnn.models.checkpoint import model_kind
from hybridgnn.models.checkpoint import weights_fingerprint as model_fingerprint
from hybridgnn.profiling.runner import BatchGenerator, ProfileConfig, run_closed_loop
from hybridgnn.scheduler.curves import Curve, Samples, bin_statistics
from hybridgnn.scheduler.policy import (
    SCHEMA_VERSION,
    Profile,
    _curve_dict,
)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def other_lane_busy(resources, serve_cfg, name: str, num_nodes: int, max_batch: int, loaded: bool):
    """With `loaded` (ProfileConfig.other_lane_loaded), while pipeline `name` is profiled,
    keep the other lane's device work going when the two share the GPU (a split CPU lane):
    one worker of the other pipeline runs batches of random seeds closed loop, so each lane
    is measured beside the other. Otherwise nothing else runs: each lane is measured
    alone, and an SLO choice puts the two on one simulated device instead (counting the
    contention once, not twice)."""
    other = "gpu" if name == "cpu" else "cpu"
    if not loaded or not serve_cfg.cpu_pipeline.split or serve_cfg.gpu_pipeline is None:
        yield
        return
    executor = resources.make_executor(other, 10_000)  # a worker number no served worker has
    stop = threading.Event()
    rng = np.random.default_rng(1)

    def load() -> None:
        while not stop.is_set():
            executor.run(rng.integers(0, num_nodes, max(1, max_batch // 8), dtype=np.int64))

    thread = threading.Thread(target=load, name=f"profile-load-{other}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if hasattr(executor, "close"):
            executor.close()


def build_profile(serve_cfg, cfg: ProfileConfig, *, progress: bool = True) -> dict:
    """Profile every pipeline of a server built from serve_cfg (engine not started)."""
    from tqdm import tqdm

    from hybridgnn.capabilities import describe
    from hybridgnn.runtime.resources import Resources

    resources = Resources.open(serve_cfg)
    pipelines = {p.name: p for p in (serve_cfg.cpu_pipeline, serve_cfg.gpu_pipeline) if p is not None}
    psgs = np.asarray(resources.tables.psgs, dtype=np.float64)
    gen = BatchGenerator(psgs, cfg)
    result = {
        "schema_version": SCHEMA_VERSION,
        "created_unix_s": time.time(),
        "hardware": describe(),
        "dataset": {"name": resources.graph.name, "fingerprint": resources.graph.fingerprint,
                    "num_nodes": resources.graph.num_nodes, "num_edges": resources.graph.num_edges},
        "model": {"kind": model_kind(resources.model_config), "num_layers": resources.model.num_layers,
                  "fingerprint": model_fingerprint(serve_cfg.model_dir)},
        "fanouts": list(resources.cfg.sampling.fanouts),  # as served (the model's, cut to its layers)
        "mean_seed_psgs": float(psgs.mean()),
        # what requests are drawn from when an SLO choice simulates serving
        "seed_psgs_quantiles": [round(float(v), 3) for v in np.quantile(psgs, (np.arange(1024) + 0.5) / 1024)],
        "config": {"bins": cfg.bins, "min_samples": cfg.min_samples, "max_batch": cfg.max_batch,
                   "buckets": cfg.buckets, "budget_s": cfg.budget_s, "other_lane_loaded": cfg.other_lane_loaded},
        "bin_edges": [float(e) for e in gen.edges],
        "pipelines": {},
    }
    loaded = bool(cfg.other_lane_loaded and serve_cfg.cpu_pipeline.split and serve_cfg.gpu_pipeline is not None)
    try:
        for name, pipeline in pipelines.items():
            executors = [resources.make_executor(name, w) for w in range(pipeline.workers)]
            executors[0].run(np.arange(4, dtype=np.int64))  # compile and warm outside the samples
            bar = tqdm(desc=f"profile {name}", unit="batch", disable=not progress)
            t0 = time.perf_counter()
            try:
                with other_lane_busy(resources, serve_cfg, name, psgs.size, cfg.max_batch, loaded):
                    samples, complete = run_closed_loop(lambda w, seeds, ex=executors: ex[w].run(seeds),
                                                        pipeline.workers, gen, cfg, progress=bar.update,
                                                        own_service=bool(pipeline.split and not loaded))
            finally:
                bar.close()
                for ex in executors:  # worker processes, when the pipeline has them
                    if hasattr(ex, "close"):
                        ex.close()
            if not complete:
                log.warning("profile of %s stopped at the %.0f s budget before every PSGS bin had %d samples",
                            name, cfg.budget_s, cfg.min_samples)
            stats = bin_statistics(samples, gen.edges)
            curves = {"mean": _curve_dict(Curve.fit(stats["psgs"], stats["mean_s"], stats["count"])),
                      "tail": _curve_dict(Curve.fit(stats["psgs"], stats["tail_s"], stats["count"]))}
            if pipeline.split and not loaded and len(samples.device) == len(samples.psgs):
                # the share of each batch the GPU does: the simulator queues it with the GPU lane's
                shares = bin_statistics(Samples(samples.psgs, samples.device, samples.seeds), gen.edges)
                curves["device"] = _curve_dict(Curve.fit(shares["psgs"], shares["mean_s"], shares["count"]))
            result["pipelines"][name] = {
                "device": pipeline.device, "workers": pipeline.workers,
                "torch_threads": pipeline.torch_threads, "processes": pipeline.processes,
                "split": pipeline.split, "other_lane_loaded": loaded,
                "samples": len(samples.psgs),
                "complete": complete, "seconds": time.perf_counter() - t0, "bins": stats,
                "curves": curves,
                "raw": {"psgs": [round(v, 2) for v in samples.psgs],
                        "seconds": [round(v, 7) for v in samples.seconds]},
            }
    finally:
        resources.close()
    loaded = Profile(result)
    if set(loaded.devices) == {"cpu", "gpu"}:
        result["points"] = {k: p.to_dict() for k, p in loaded.points().items()}
    return result
