"""`hybridgnn cluster`: N replicas of `hybridgnn serve` behind HAProxy or nginx on one machine."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hybridgnn.cli.flags import DefaultsHelpFormatter, user_path
from hybridgnn.config import env_default
from hybridgnn.deploy.balancer import BALANCERS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "cluster", help="run N serve replicas behind a load balancer on this machine",
        description="Start N replicas of `hybridgnn serve` (ports base-port..base-port+N-1) and HAProxy or nginx "
                    "on --port, wait until all are ready, and supervise until Ctrl-C/SIGTERM, which drains the "
                    "replicas and stops the balancer; a replica that exits is started again after a backoff. Arguments "
                    "after `--` go to every `hybridgnn serve`. "
                    "The run directory holds the balancer config, logs, and replica-<i>.pid/.exit files.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--replicas", type=int, default=env_default("REPLICAS", 3, int), help="serve replicas to run")
    p.add_argument("--balancer", choices=BALANCERS, default=env_default("BALANCER", "haproxy"),
                   help="load balancer in front of them")
    p.add_argument("--host", default="127.0.0.1", help="address the balancer and replicas listen on")
    p.add_argument("--port", type=int, default=env_default("PORT", 8000, int), help="the balancer's port")
    p.add_argument("--base-port", type=int, default=8001, help="port of the first replica")
    p.add_argument("--run-dir", type=user_path, default=Path("run/cluster"),
                   help="logs, pid files and the balancer's config")
    p.add_argument("--ready-timeout-s", type=float, default=300.0,
                   help="how long replicas may take to start (the demo trains its model on first run)")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="leave a replica that exits down (by default it is started again after a backoff)")
    p.add_argument("--restart-backoff-s", type=float, default=1.0,
                   help="wait before restarting a replica that exited; doubles per crash up to 30 s, and resets "
                        "once it has stayed up a minute")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for `hybridgnn serve`")
    p.set_defaults(run=run)


def run(args) -> int:
    from hybridgnn.deploy.cluster import ClusterConfig, LocalCluster

    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    served = _served(serve_args)
    if served.worker_cpus and not any(a == "--worker-cpus" or a.startswith("--worker-cpus=") for a in serve_args):
        # HYBRIDGNN_WORKER_CPUS, which every replica inherits: split as the flag is, not every
        # replica's workers on all of them
        serve_args += ["--worker-cpus", served.worker_cpus]
    # The cluster's own flags are checked before the demo is made (its first run takes ~30 s).
    cfg = ClusterConfig(replicas=args.replicas, balancer=args.balancer, host=args.host, port=args.port,
                        base_port=args.base_port, run_dir=args.run_dir, serve_args=tuple(serve_args),
                        ready_timeout_s=args.ready_timeout_s, restart=args.restart,
                        restart_backoff_s=args.restart_backoff_s)
    if served.dataset is None:
        # Build the demo once here, not in N replicas racing on the same cache directory:
        # where the replicas' --cache-dir (or HYBRIDGNN_CACHE_DIR) puts it
        from hybridgnn.demo import ensure_demo

        dataset, model = ensure_demo(served.cache_dir)
        cfg = dataclasses.replace(cfg, serve_args=(*serve_args, "--dataset", str(dataset), "--model", str(model)))
    try:
        return LocalCluster(cfg).run_until_signal()
    except (RuntimeError, TimeoutError) as exc:  # a replica or the balancer failed to start
        said = str(exc)  # a replica's failure names its own log
        raise ValueError(said if str(cfg.run_dir) in said else f"{said} (logs in {cfg.run_dir})") from exc


def _served(serve_args: list[str]) -> argparse.Namespace:
    """What the replicas' `hybridgnn serve` reads from these flags and HYBRIDGNN_* variables
    (the replicas inherit them): a dataset given either way is served, not the demo."""
    from hybridgnn.cli.main import build_parser

    return build_parser().parse_known_args(["serve", *serve_args])[0]
