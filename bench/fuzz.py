"""Fuzz the HTTP server for many cases: the generators of tests/integration/test_fuzz.py
(tests.support.fuzz: KServe JSON bodies, binary-tensor bodies with lying
Inference-Header-Content-Length, graph updates, mutated raw HTTP bytes) against a server
this script starts (the demo graph and model, or --dataset/--model, or --small: a 3,000-node
graph built in a temporary directory), or a running one (--url, with --token for updates).

Prints the machine, answers counted by kind and status, 5xx answers, error bodies that are
not JSON {"error": ...}, raw bytes answered other than llhttp parses them, the slowest
answer, whether the process is alive, and whether a good inference answers exactly as it
did before; exits 1 if any check fails.

    .venv/bin/python bench/fuzz.py [--cases 100000] [--small] [--url URL --token T] [--seed S]
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

from bench.common import machine, strict_json  # noqa: E402
from tests.support.fuzz import (  # noqa: E402
    KINDS,
    KeepAliveClient,
    NoAnswer,
    Target,
    good_case,
    problem_kind,
    run_case,
)
from tests.support.server import free_port  # noqa: E402

# share of the cases per kind (as in tests/integration/test_fuzz.py: 700/300/400/600)
SHARES = {"json": 0.35, "binary": 0.15, "graph": 0.20, "raw": 0.30}
EXAMPLES_KEPT = 3  # problems shown per category


def small_dataset(root: Path) -> tuple[Path, Path]:
    """A 3,000-node CSBM graph and a tiny SAGE with precomputed embeddings (as the tests use)."""
    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.graph.generate import generate_csbm
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_checkpoint
    from hybridgnn.models.train import TrainConfig, train

    data, model_dir = root / "csbm", root / "sage"
    generate_csbm(data, num_nodes=3000, num_classes=4, feature_dim=16, avg_degree=8, feature_signal=0.3, seed=1)
    graph = GraphStore.open(data)
    model, metrics = train(graph, TrainConfig(kind="sage", hidden_dim=16, fanouts=(5, 3), epochs=3, batch_size=64),
                           progress=False)
    save_checkpoint(model, model_dir, extra={"dataset_fingerprint": graph.fingerprint, "fanouts": [5, 3],
                                             "metrics": metrics})
    precompute(graph, model, model_dir, progress=False)
    return data, model_dir


class Server:
    """`hybridgnn serve` as a child process, the update token passed in its environment."""

    def __init__(self, dataset: Path, model: Path, token: str, extra: list[str]):
        self.port = free_port()
        cmd = [sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "serve", "--dataset",
               str(dataset), "--model", str(model), "--port", str(self.port), "--update-log", "off", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYBRIDGNN_UPDATE_TOKEN": token}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)  # poll interval, bounded by the deadline
        raise TimeoutError(f"server not ready within {timeout_s} s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Tally:
    def __init__(self):
        self.statuses: dict[str, Counter] = {kind: Counter() for kind in KINDS}
        self.cases: Counter = Counter()
        self.problems: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.slowest_s = 0.0
        self.slowest_case = ""
        self.died_on: str | None = None

    def add(self, kind: str, case, outcome) -> None:
        self.cases[kind] += 1
        self.statuses[kind].update(outcome.statuses or ["none"])
        if outcome.slowest_s > self.slowest_s:
            self.slowest_s, self.slowest_case = outcome.slowest_s, repr(case)[:300]
        for problem in outcome.problems:
            cat = problem_kind(problem)
            self.problems[cat] += 1
            kept = self.examples.setdefault(cat, [])
            if len(kept) < EXAMPLES_KEPT:
                kept.append(f"{problem[:300]} <- {case!r}"[:900])


def fuzz_kind(kind: str, n: int, target: Target, client: KeepAliveClient, tally: Tally, alive, seed: int | None,
              progress_every: int) -> None:
    strategy = KINDS[kind](target)
    good = good_case(target)

    def good_answers() -> bool:
        probe = KeepAliveClient(target.host, target.port, 2.0)
        try:
            return probe.request(good.method, good.path, good.body, good.headers).status == 200
        except (NoAnswer, OSError):
            return False
        finally:
            probe.close()

    @settings(max_examples=n, deadline=None, database=None, derandomize=seed is None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=strategy)
    def one(case):
        if tally.died_on is not None:
            return
        outcome = run_case(client, target, case)
        tally.add(kind, case, outcome)
        if (outcome.problems or alive.cheap) and not alive():  # over HTTP (--url) only after a problem
            tally.died_on = f"died on {case!r}"[:900]
        elif any(problem_kind(p) in ("slow", "no_answer") for p in outcome.problems) and not good_answers():
            tally.died_on = f"stopped answering after {case!r}"[:900]  # later cases would each time out
        done = sum(tally.cases.values())
        if progress_every and done % progress_every == 0:
            print(f"  {done} cases, problems {dict(tally.problems)}", file=sys.stderr, flush=True)

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    one()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--url", default=None, help="fuzz a running server instead of starting one")
    ap.add_argument("--token", default=os.environ.get("HYBRIDGNN_UPDATE_TOKEN"),
                    help="with --url: the server's update token (graph updates are refused without it)")
    ap.add_argument("--dataset", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--small", action="store_true", help="a 3,000-node graph built in a temporary directory")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized, reproducible)")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="longest an answer may take")
    ap.add_argument("--progress-every", type=int, default=10_000)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then extra flags for `hybridgnn serve`")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}")

    server, tmp = None, None
    if args.url:
        parts = urlsplit(args.url)
        host, port, token = parts.hostname or "127.0.0.1", parts.port or 80, args.token
    else:
        if args.small:
            tmp = tempfile.TemporaryDirectory(prefix="hybridgnn-fuzz-")
            dataset, model = small_dataset(Path(tmp.name))
        elif args.dataset and args.model:
            dataset, model = args.dataset, args.model
        else:
            from hybridgnn.demo import ensure_demo

            dataset, model = ensure_demo()
        token = secrets.token_urlsafe(16)
        extra = [a for a in args.serve_args if a != "--"]
        server = Server(dataset, model, token, ["--workers", "1", *extra])
        server.wait_ready()
        host, port = "127.0.0.1", server.port

    def alive() -> bool:
        if server is not None:
            return server.alive()
        try:
            return KeepAliveClient(host, port, args.timeout_s).request("GET", "/v2/health/live").status == 200
        except (NoAnswer, OSError):
            return False

    alive.cheap = server is not None  # a look at the child process, not a request
    rc = 0
    try:
        target = Target.discover(host, port, token)
        client = KeepAliveClient(host, port, args.timeout_s)
        good = good_case(target)
        before = client.request(good.method, good.path, good.body, good.headers)
        tally = Tally()
        started = time.perf_counter()
        share = sum(SHARES[k] for k in kinds)
        for kind in kinds:
            n = max(1, round(args.cases * SHARES[kind] / share))
            fuzz_kind(kind, n, target, client, tally, alive, args.seed, args.progress_every)
            if tally.died_on is not None:
                break
        elapsed = time.perf_counter() - started
        is_alive = alive()
        try:
            after = KeepAliveClient(host, port, args.timeout_s).request(good.method, good.path, good.body, good.headers)
            same = before.status == 200 and after.status == before.status and after.body == before.body
        except (NoAnswer, OSError) as exc:
            after, same = None, False
            print(f"good request after fuzzing failed: {exc}", file=sys.stderr)
        report = {
            "machine": machine(),
            "server": args.url or f"started here ({'small graph' if args.small else 'dataset ' + str(dataset)})",
            "cases": sum(tally.cases.values()),
            "cases_per_s": round(sum(tally.cases.values()) / elapsed, 1),
            "seconds": round(elapsed, 1),
            "by_kind": {k: {"cases": tally.cases[k], "statuses": {str(s): c for s, c in sorted(
                tally.statuses[k].items(), key=lambda kv: str(kv[0]))}} for k in kinds},
            "answers_5xx": tally.problems["5xx"],
            "non_json_error_bodies": tally.problems["non_json_error"],
            "raw_desync": tally.problems["desync"],
            "problems": dict(tally.problems),
            "slowest_answer_s": round(tally.slowest_s, 3),
            "slowest_case": tally.slowest_case,
            "process_alive": is_alive,
            "stopped": tally.died_on,
            "good_request_unchanged": same,
            "problem_examples": tally.examples,
        }
        print(strict_json(report))
        if tally.problems or not is_alive or not same or tally.died_on:
            rc = 1
    finally:
        if server is not None:
            code = server.stop()
            if code != 0:
                print(f"server exited with {code}:\n{server.output()}", file=sys.stderr)
                rc = 1
        if tmp is not None:
            tmp.cleanup()
    return rc


if __name__ == "__main__":
    sys.exit(main())
