"""The profile plot: per device, mean and p99 latency against batch PSGS (the band
between them shaded, raw batches faint behind), the four operating points marked."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from hybridgnn.capabilities import write_replacing

COLOURS = {"cpu": "#1f77b4", "gpu": "#d62728"}
POINT_LABELS = {"cpu_preferred": "CPU-preferred", "gpu_preferred": "GPU-preferred",
                "latency_preferred": "latency-preferred", "throughput_preferred": "throughput-preferred"}


def plot_paths(out_stem: Path) -> list[Path]:
    """out_stem.png and out_stem.svg, the stem's dots kept: with_suffix made the plots of
    profiles/g.v2.json profiles/g.png and .svg, over those of profiles/g.json."""
    out_stem = Path(out_stem)
    return [out_stem.with_name(out_stem.name + ext) for ext in (".png", ".svg")]


def plot_profile(profile, out_stem: Path) -> list[Path]:
    """Write out_stem.png and out_stem.svg; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = profile.data
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    xs = np.exp(np.linspace(math.log(profile.lo), math.log(profile.hi), 300))
    for name, curves in profile.devices.items():
        colour = COLOURS.get(name, "#444444")
        pipe = data["pipelines"][name]
        raw = pipe.get("raw", {})
        if raw.get("psgs"):
            ax.scatter(raw["psgs"], np.asarray(raw["seconds"]) * 1e3, s=3, alpha=0.12, color=colour, linewidths=0)
        mean, tail = curves.mean(xs) * 1e3, curves.tail(xs) * 1e3
        label = f"{name} pipeline on {pipe['device']} ({pipe['workers']} workers)"
        ax.plot(xs, mean, color=colour, lw=2, label=f"{label}: mean")
        ax.plot(xs, tail, color=colour, lw=1.5, ls="--", label=f"{label}: p99")
        ax.fill_between(xs, mean, tail, color=colour, alpha=0.15)
    for i, (key, point) in enumerate((data.get("points") or {}).items()):
        thr = point["psgs_threshold"]
        if thr == "inf" or not (profile.lo <= float(thr) <= profile.hi):
            continue
        ax.axvline(float(thr), color="#555555", lw=0.8, ls=":")
        ax.annotate(POINT_LABELS.get(key, key), (float(thr), 0.97 - 0.06 * i), xycoords=("data", "axes fraction"),
                    rotation=90, ha="right", va="top", fontsize=8, color="#333333")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch PSGS (expected sampled nodes)")
    ax.set_ylabel("latency per batch (ms)")
    hw = data["hardware"]
    ax.set_title(f"{data['dataset']['name']} · {data['model']['kind']} · fanouts {','.join(map(str, data['fanouts']))}"
                 f"\n{hw.get('cpu', '?')} ({hw.get('cpu_count', '?')} cores)"
                 + (", " + ", ".join(hw["gpus"]) if hw.get("gpus") else ", no GPU"), fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    paths = plot_paths(out_stem)
    for p in paths:
        write_replacing(p, fig.savefig)  # whole or not at all, as the profile itself
    plt.close(fig)
    return paths
