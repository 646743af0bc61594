"""What a worker process's answer costs to send and read: the server's own framing
(hybridgnn.pipelines.process: write_message and MessageReader, arrays past 64 KiB beside
a protocol-5 pickle as raw buffers) against multiprocessing's Connection.send/recv (one
pickle of everything, the framing the server used before), in the same run.

A batch's answer as a child sends it (logits of 47 classes, 256-wide embeddings,
predictions, the stage times) for batches of --seeds, written on one thread and read on
another over a socketpair (answers past the socket's buffer need both at once). The
figure per size is the median over --rounds of the mean time per answer; read ÷ write
costs are not split: a small answer's cost is one write and one read either way.

    .venv/bin/python bench/worker_messages.py [--seeds 1,1000,20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing.connection
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, machine  # noqa: E402
from hybridgnn.pipelines.process import MessageReader, write_message  # noqa: E402


def answer(seeds: int) -> tuple:
    rng = np.random.default_rng(seeds)
    return ("ok", (rng.random((seeds, 47), dtype=np.float32), rng.random((seeds, 256), dtype=np.float32),
                   np.arange(seeds, dtype=np.int64), 1e-3, 2e-3, 3e-3, 40 * seeds, {"host": 30 * seeds}))


def per_answer_s(send, receive, message, count: int) -> float:
    """Mean seconds per answer: `count` of them sent on a thread, received here."""
    writer = threading.Thread(target=lambda: [send(message) for _ in range(count)])
    t0 = time.perf_counter()
    writer.start()
    for _ in range(count):
        receive()
    writer.join()
    return (time.perf_counter() - t0) / count


def framing(message, count: int) -> float:
    a, b = socket.socketpair()
    with a, b:
        reader = MessageReader(b)
        return per_answer_s(lambda m: write_message(a, m), reader.read, message, count)


def connection(message, count: int) -> float:
    a, b = multiprocessing.connection.Pipe()
    with a, b:
        return per_answer_s(a.send, b.recv, message, count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,1000,20000", help="batch sizes (seeds per answer)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sizes = {}
    for seeds in (int(s) for s in args.seeds.split(",")):
        message = answer(seeds)
        megabytes = sum(a.nbytes for a in message[1][:3]) / 1e6
        count = max(5, min(20_000, int(20e6 / max(1.0, megabytes * 1e6) * 10)))
        ours, theirs = [], []
        for _ in range(args.rounds):  # alternating, so drift falls on both
            ours.append(framing(message, count))
            theirs.append(connection(message, count))
        mine, before = statistics.median(ours), statistics.median(theirs)
        sizes[seeds] = {"megabytes": round(megabytes, 3), "answers_per_round": count,
                        "framing_us": round(mine * 1e6, 2), "connection_us": round(before * 1e6, 2),
                        "framing_vs_connection": round(mine / before, 2)}
        print(f"{seeds} seeds ({megabytes:.2f} MB): framing {mine * 1e6:.1f} µs, Connection {before * 1e6:.1f} µs, "
              f"ratio {mine / before:.2f}", flush=True)
    emit_report({"machine": machine(), "rounds": args.rounds, "sizes": sizes}, args.out)


if __name__ == "__main__":
    main()
