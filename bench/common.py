"""Helpers shared by the benchmark scripts: the machine line, the products-scale graph,
per-thread CPU from /proc, and servers run from another git revision of this repository
(`serve_revision` / `RevisionServer`, for before/after comparisons in one run).

Bench scripts run as `python bench/x.py` from anywhere: each puts the repository root first on
sys.path before its first `from bench... import`, which is what makes `bench` and the shared
test helpers in `tests.support` (not part of the installed package) importable."""

from __future__ import annotations

import fcntl
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from hybridgnn.bench.report import strict_json
from hybridgnn.capabilities import describe_line
from tests.support.server import await_ready, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
# The processes a bench starts with `python -m hybridgnn...` (servers, generators, profiles)
# import hybridgnn from their working directory first, else from the venv's editable
# install, which may be another checkout: run from anywhere but the repository root, they
# ran that checkout's code beside this one's. This tree goes first on their PYTHONPATH
# (revision_env puts a revision's worktree before it).
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != str(ROOT):
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
DATA = Path(os.environ.get("HYBRIDGNN_BENCH_DATA", ROOT / "data"))
PRODUCTS = DATA / "products-powerlaw"
PRODUCTS_ARGS = ["--num-nodes", "2400000", "--avg-degree", "51.5", "--feature-dim", "100", "--seed", "0"]


def machine() -> str:
    return describe_line()


def progress(row) -> None:
    """One progress line of a benchmark: compact strict JSON (a figure with no value is null)."""
    print(strict_json(row, indent=None), flush=True)


def emit_report(report: dict, out: Path | None) -> None:
    """Print a bench's JSON report last (what a device run's output tail carries) and
    write it to `out` when given; strict JSON (strict_json: a figure with no value is
    null, never NaN)."""
    text = strict_json(report)
    print(text)
    if out is not None:
        Path(out).write_text(text)


def ensure_products(path: Path = PRODUCTS) -> dict:
    """Generate the ogbn-products-scale power-law graph (once) in a child process and return
    its wall time and peak RSS; reuse an existing one (times then None)."""
    return ensure_graph(path, PRODUCTS_ARGS)


def ensure_graph(path: Path, generate_args: list[str]) -> dict:
    """Generate a power-law graph with these `dataset generate powerlaw` flags (once)."""
    if (path / "meta.json").is_file():
        return {"generate_s": None, "peak_rss_gib": None}
    t0 = time.perf_counter()
    # --force: what is there without a meta.json is no dataset (a run killed before the
    # generator staged its output), and generate refuses a non-empty --out without it
    subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "dataset", "generate",
                    "powerlaw", "--out", str(path), "--force", *generate_args], check=True)
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"generate_s": time.perf_counter() - t0, "peak_rss_gib": rss_kib / 2**20}


def _stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of a /proc .../stat file."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _runtime_seconds(pid: int) -> float | None:
    """On-CPU seconds of every thread of a process, from the scheduler's own nanosecond
    accounting (/proc/PID/task/TID/sched, se.sum_exec_runtime in ms); None where the kernel
    does not offer it. /proc's stat fields are sampled at the clock tick instead: a server
    that runs in bursts of tens of microseconds gets too few samples in a few seconds for
    a figure within 10 %."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0  # it ended
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/sched").read_text()
        except FileNotFoundError:
            return None
        except OSError:  # the thread ended
            continue
        at = text.find("se.sum_exec_runtime")
        if at < 0:
            return None
        total += float(text[text.index(":", at) + 1:text.index("\n", at)]) / 1e3
    return total


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and every process it started (all threads): precise where
    the kernel's scheduler accounting is readable (_runtime_seconds), else user + system
    from /proc stat."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        precise = _runtime_seconds(p)
        if precise is None:
            return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text()) + descendants_cpu_seconds(pid)
        total += precise
    return total


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each named thread of a process, summed by name (Linux)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        out[name] = out.get(name, 0.0) + _stat_cpu_seconds(stat)
    return out


def descendants(pid: int) -> list[int]:
    """The pids of a process's descendants still running (Linux)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:  # it ended
            continue
        for tid in tids:
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def descendants_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a process's descendants still running,
    e.g. a server's pipeline worker processes (Linux)."""
    total = 0.0
    for child in descendants(pid):
        try:
            total += _stat_cpu_seconds(Path(f"/proc/{child}/stat").read_text())
        except OSError:
            continue
    return total


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process's main thread, where its event loop runs (Linux): from the
    scheduler's nanosecond accounting where readable (see _runtime_seconds: the clock-tick
    figure of /proc stat moves in 10 ms steps, coarser than a short run's loop CPU), else
    user + system from /proc stat."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/sched").read_text()
    except FileNotFoundError:
        text = ""
    at = text.find("se.sum_exec_runtime")
    if at >= 0:
        return float(text[text.index(":", at) + 1:text.index("\n", at)]) / 1e3
    return _stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat").read_text())


HEAVY_FANOUTS = {3: [15, 10, 5], 2: [15, 10]}  # 2 layers: Quiver's products setting


def heavy_setup(layers: int = 3):
    """The products-scale graph and a SAGE of `layers` layers (hidden 256, fanouts
    HEAVY_FANOUTS[layers]) with random weights."""
    import torch

    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_checkpoint
    from hybridgnn.models.gnn import GNN, ModelSpec

    ensure_products(PRODUCTS)
    model_dir = PRODUCTS.parent / f"products-sage{layers}-256"
    if not (model_dir / "golden.pt").is_file():
        graph = GraphStore.open(PRODUCTS)
        torch.manual_seed(0)
        model = GNN(ModelSpec("sage", graph.feature_dim, 256, 47, num_layers=layers)).eval()
        save_checkpoint(model, model_dir, extra={"fanouts": HEAVY_FANOUTS[layers],
                                                 "dataset_fingerprint": graph.fingerprint})
    return PRODUCTS, model_dir


# --- servers from another git revision ------------------------------------------------

# The code before the llhttp front end and queue-delay admission (hand-written HTTP
# parser, a fixed --max-pending 2048 cap, the aiohttp front end as an option).
BASELINE_REV = "e9a9a2f"
WORKTREE_PREFIX = "/tmp/hybridgnn-rev-"


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def revision_worktree(rev: str) -> Path:
    """A detached worktree of this repository at `rev` in /tmp/hybridgnn-rev-<rev>, made
    once with `git worktree add --detach` and reused afterwards (checked to be at that
    commit). A lock file serialises concurrent callers."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", rev) or rev.startswith("-"):
        raise ValueError(f"revision {rev!r}: give a commit hash or a tag/branch name without '/' or '~'")
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = Path(f"{WORKTREE_PREFIX}{rev}")
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / ".git").exists():
            head = _git("rev-parse", "HEAD", cwd=path)
            if head != commit:
                raise RuntimeError(f"{path} is a worktree at {head[:12]}, not {rev} ({commit[:12]}); "
                                   f"remove it (git worktree remove {path}) and run again")
            return path
        if path.exists() and any(path.iterdir()):
            raise RuntimeError(f"{path} exists and is not a worktree of {ROOT}; remove it and run again")
        registered = f"worktree {path}" in _git("worktree", "list", "--porcelain").splitlines()
        # -f: registered but its directory was deleted (e.g. /tmp cleaned); git refuses without it
        _git("worktree", "add", *(["-f"] if registered else []), "--detach", str(path), commit)
    return path


def revision_env(rev: str | None) -> tuple[Path, dict[str, str]]:
    """(working directory, environment) in which this interpreter imports hybridgnn from
    git revision `rev` (its worktree first on PYTHONPATH), or from this tree when rev is None."""
    worktree = revision_worktree(rev) if rev is not None else ROOT
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if rev is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(worktree), *filter(None, [os.environ.get("PYTHONPATH")])])
        # The venv's editable install must not win over the worktree: check where the
        # package resolves (find_spec does not import it).
        where = subprocess.run([sys.executable, "-c",
                                "import importlib.util as u; print(u.find_spec('hybridgnn').origin)"],
                               cwd=worktree, env=env, check=True, capture_output=True, text=True).stdout.strip()
        if not Path(where).resolve().is_relative_to(worktree.resolve()):
            raise RuntimeError(f"hybridgnn resolves to {where}, not the worktree {worktree}")
    return worktree, env


def serve_accepts(rev: str | None, flag: str) -> bool:
    """Whether `hybridgnn serve` of git revision `rev` (None: this tree) takes `flag`, from
    its own --help (flags are generated from the settings, so no source text says it)."""
    cwd, env = revision_env(rev)
    shown = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "serve", "--help"], cwd=cwd, env=env,
                           capture_output=True, text=True, check=True).stdout
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", shown) is not None


class RevisionServer:
    """`hybridgnn serve --dataset D --model M --port P *extra` running the code of git
    revision `rev` (its worktree first on PYTHONPATH and the working directory; same
    interpreter and venv), or of this working tree when rev is None. The interface of
    tests/support/server.py's ServerProcess (url, port, proc, wait_ready(), output(),
    stop()) plus pid. The server's output goes to a temporary file, not a pipe, so a
    chatty server never blocks on a full pipe while a benchmark is not reading it."""

    def __init__(self, rev: str | None, dataset, model, *extra: str, port: int | None = None,
                 cpus: set[int] | None = None):
        import tempfile

        self.rev = rev
        self.worktree, env = revision_env(rev)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "serve", "--dataset",
               str(dataset), "--model", str(model), "--port", str(self.port), *extra]
        self._log = tempfile.TemporaryFile()
        # cpus: the server and every process it starts run on these cores only (a benchmark
        # keeps its load generator off them).
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=self.worktree, preexec_fn=pin)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def label(self) -> str:
        return f"revision {self.rev}" if self.rev is not None else "working tree"

    def wait_ready(self, timeout_s: float = 180.0) -> "RevisionServer":
        await_ready(self, f"server ({self.label})", timeout_s)
        return self

    def output(self) -> str:
        """What the server printed so far (all of it once it has exited)."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        return stop_process(self.proc, timeout_s)


def model_for_revision(rev: str | None, model) -> Path:
    """A model directory that revision `rev` can load: the model itself, or, for revisions
    before config.json format 2 (which read {"spec": {...}}), a sibling directory in the
    old layout with the same weights and embeddings (linked, not copied)."""
    model = Path(model)
    config = json.loads((model / "config.json").read_text())
    if rev is None or config.get("format") != 2 or config.get("class") != "hybridgnn.GNN":
        return model
    reads_format_2 = '"format"' in _git("show", f"{rev}:hybridgnn/models/checkpoint.py")
    if reads_format_2:
        return model
    legacy = model.with_name(model.name + "-legacy-format")
    legacy.mkdir(exist_ok=True)
    args = config["args"]
    old = {"spec": {k: args[k] for k in ("kind", "in_dim", "hidden_dim", "out_dim", "num_layers", "heads",
                                         "dropout") if k in args},
           **{k: v for k, v in config.items() if k not in ("format", "class", "args")}}
    (legacy / "config.json").write_text(json.dumps(old, indent=2) + "\n")
    for name in ("model.pt", "embeddings"):
        link = legacy / name
        if (model / name).exists() and not link.exists():
            link.symlink_to((model / name).resolve())
    return legacy


def serve_revision(rev: str | None, dataset, model, *extra: str, timeout_s: float = 180.0,
                   cpus: set[int] | None = None) -> RevisionServer:
    """Start `hybridgnn serve` from git revision `rev` (None: this working tree), on `cpus`
    if given, and wait until it is ready; stop() it when done. An older revision gets the
    model in the layout it reads (model_for_revision)."""
    return RevisionServer(rev, dataset, model_for_revision(rev, model), *extra, cpus=cpus).wait_ready(timeout_s)


