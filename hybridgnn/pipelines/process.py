"""CPU pipeline workers whose batches run in their own processes (`serve --worker-processes`).

Each worker is a child process: it gets a batch's seed ids over a pipe, runs the same
BatchExecutor a worker thread would have run (built from the same ServeConfig by the
factory it is given, runtime/'s) and sends back the outputs. The serving engine's event
loop drives the pipes itself (process_pipeline.py); ProcessExecutor.run() is the
blocking form, for the profiler. Each process has its own interpreter, so the event
loop's Python (HTTP, batching, responses) no longer takes turns with the model's. The
graph, features and workload tables are memory-mapped files, so the children read the
same page-cache pages as the server: nothing is copied per worker except the model
weights.

A child that dies (killed, out of memory) or hangs (no answer within the batch timeout)
fails the batch it held with an error the requests see, and is started again for the
next batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import threading
import time

import numpy as np

from hybridgnn.pipelines.liveness import (
    LIVENESS_CHECK_S,
    ChildActivity,
    Liveness,
    batch_timeout_s,
    read_activity,
)
from hybridgnn.types import BatchResult, StageTimings

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # building a child's executor opens the dataset and loads the model


# A child's message to the server: `<u64 pickle bytes><u32 buffers>`, `<u64>` per buffer,
# the pickle (protocol 5), then the buffers. Arrays past OUT_OF_BAND_BYTES travel as raw
# buffers outside the pickle: written from their own memory and read into the arrays the
# server answers with, never copied into and out of a pickle stream.
MESSAGE_HEAD = struct.Struct("<QI")
OUT_OF_BAND_BYTES = 64 * 1024
# A read or write that moves no byte for this long fails (the child is then replaced): a
# child stopped mid-message must not hold the profiler, nor a write from a thread for ever.
STALL_S = 10
MAX_BUFFERS = 1024  # more is a broken stream (a batch's answer holds a handful of arrays)
PENDING = object()


def encode_message(message) -> list:
    """One message (any picklable value) as the parts write_message sends: raises what
    pickling raises, before anything is written (the stream stays in step)."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buf: pickle.PickleBuffer):
        if buf.raw().nbytes < OUT_OF_BAND_BYTES:
            return True  # in the pickle: one write for a small answer
        buffers.append(buf)
        return None

    data = pickle.dumps(message, protocol=5, buffer_callback=out_of_band)
    raws = [b.raw() for b in buffers]
    head = MESSAGE_HEAD.pack(len(data), len(raws)) + struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    return [head + data] if not raws else [head, data, *raws]


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send one encoded message (encode_message's parts) whole; blocks until the socket took it."""
    for part in parts:
        sock.sendall(part)


def write_message(sock: socket.socket, message) -> None:
    """Send one message whole."""
    send_parts(sock, encode_message(message))


def _message_parts():
    """The buffers a message is read into, in order (each yielded to be filled); returns the
    message. Writable arrays: numpy arrays over the buffers, owned by the reader's caller."""
    head = bytearray(MESSAGE_HEAD.size)
    yield head
    size, count = MESSAGE_HEAD.unpack(head)
    if count > MAX_BUFFERS:
        raise ValueError(f"a message of {count} buffers")
    lengths = bytearray(8 * count)
    yield lengths
    data = bytearray(size)
    yield data
    buffers = []
    for n in struct.unpack(f"<{count}Q", lengths):
        buffers.append(bytearray(n))
        yield buffers[-1]
    return pickle.loads(data, buffers=buffers)


class MessageReader:
    """Reassembles the child's messages (write_message) from its socket, as bytes arrive.
    read(wait=False) never blocks: a message not all here yet stays part-read, and the next
    call goes on from there (the event loop's way: it reads what is there and returns)."""

    SCRATCH_BYTES = 64 * 1024  # a batch's answer of a few seeds arrives whole in one read of this

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._parts = None  # the message being read in parts (_message_parts), once begun
        self._scratch = bytearray(self.SCRATCH_BYTES)
        self._spare = memoryview(b"")  # bytes read into the scratch, not yet given to a part

    @property
    def started(self) -> bool:
        """Part of a message has arrived (the rest has not)."""
        return bool(self._spare) or (self._parts is not None and (self._filled > 0 or self._target is not self._head))

    def read(self, wait: bool = True):
        """The next whole message, or PENDING (wait=False: not all arrived yet). EOFError
        at the end of the stream; TimeoutError when waiting, past the socket's stall limit;
        what unpickling raises for a message that cannot be read (the next read starts at
        the message after it)."""
        flags = 0 if wait else socket.MSG_DONTWAIT
        if self._parts is None and not self._spare:
            # a message's first read goes to the scratch: a small message, all here, costs one
            # system call and is loaded from there (in-band arrays are copies, so the scratch
            # is free again at once)
            n = self._recv(memoryview(self._scratch), flags)
            if n is None:
                return PENDING
            head = MESSAGE_HEAD.size
            if n >= head:
                size, count = MESSAGE_HEAD.unpack_from(self._scratch)
                if count == 0 and n == head + size:
                    return pickle.loads(memoryview(self._scratch)[head:n])
            self._spare = memoryview(self._scratch)[:n]
        while True:
            if self._parts is None:
                self._parts = _message_parts()
                self._target = self._head = next(self._parts)
                self._filled = 0
            view = memoryview(self._target)
            while self._filled < len(view):
                if self._spare:
                    k = min(len(self._spare), len(view) - self._filled)
                    view[self._filled:self._filled + k] = self._spare[:k]
                    self._spare = self._spare[k:]
                    self._filled += k
                    continue
                n = self._recv(view[self._filled:], flags)
                if n is None:
                    return PENDING
                self._filled += n
            try:
                self._target, self._filled = self._parts.send(None), 0
            except StopIteration as done:
                self._parts = None
                return done.value
            except BaseException:  # a message that cannot be read: the stream is out of step for good
                self._parts = None
                raise

    def _recv(self, into: memoryview, flags: int) -> int | None:
        """Bytes read into `into` (> 0), or None: nothing there now (not waiting)."""
        try:
            n = self._sock.recv_into(into, 0, flags)
        except BlockingIOError:  # nothing there now; waiting, the stall limit passed
            if flags == 0:
                raise TimeoutError(f"the child sent nothing for {STALL_S} s") from None
            return None
        if n == 0:
            raise EOFError("the child's socket closed")
        return n

    def close(self) -> None:
        self._sock.close()


class WorkerProcessError(RuntimeError):
    """The worker process failed a batch, or exited."""


class WorkerProcessExited(WorkerProcessError):
    """The worker process is gone (exited, killed, or killed as hung): it must be restarted."""


# Signals a process group gets from a terminal, `timeout` or a service manager: the server
# acts on them for its workers, which must never die of one.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_blocked():
    """Block STOP_SIGNALS in this thread for the block: a process started in it (a worker,
    and multiprocessing's resource tracker that the first start launches) inherits the mask
    through exec, so a signal to the process group stays pending in it until it ignores
    them. Before, a worker still importing torch for seconds at the server's start died of
    a Ctrl-C with a KeyboardInterrupt traceback, and a SIGHUP (the server's cache refresh)
    killed the resource tracker, which the next worker start relaunched with a warning that
    resources might leak. Python's own resource tracker is started the same way."""
    from multiprocessing import resource_tracker

    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # launched here if not yet: it ignores SIGINT and SIGTERM, and unblocks both in this
        # thread once started, so they are blocked again for the worker's start
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _child_main(conn, cfg, worker: int, build, cpus: tuple[int, ...] = ()) -> None:
    """Build the worker's executor with build(cfg, worker) and serve batches until the
    pipe closes; on `cpus` when given (the server's --worker-cpus). Batches arrive as
    the connection's byte messages; everything sent back is a write_message."""
    # The server decides when a worker ends (pipe closed or the stop sentinel): a Ctrl-C,
    # a SIGTERM or a SIGHUP (the server's cache refresh) sent to the whole process group
    # (a terminal, `timeout`, systemd's default KillMode) must not kill it under a batch
    # mid-drain. A server killed outright closes the pipe, which ends the worker. They were
    # blocked from its start (stop_signals_blocked): ignored now, any pending is dropped.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    out = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # before torch starts threads, which inherit it
        import torch

        from hybridgnn.capabilities import freeze_startup_heap, name_os_thread

        name_os_thread(f"cpu-proc-{worker}")
        torch.set_num_threads(cfg.cpu_pipeline.torch_threads)
        executor = build(cfg, worker)
        executor.run(np.zeros(1, dtype=np.int64))  # compile outside batches
        freeze_startup_heap()
    except BaseException as exc:  # reported to the parent, which refuses to start
        message = ("error", f"{type(exc).__name__}: {exc}")
    else:
        message = ("ready", None)
    try:
        write_message(out, message)
    except OSError:  # the server is gone (killed while this worker started): nothing to serve
        return
    if message[0] != "ready":
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not data:  # the parent's stop sentinel
            return
        try:
            r = executor.run(np.frombuffer(data, dtype=np.int64))
            t = r.timings
            parts = encode_message(("ok", (r.logits, r.embeddings, r.predictions, t.sample_s, t.gather_s,
                                           t.compute_s, r.sampled_edges, r.gathered_rows)))
        except Exception as exc:  # the batch fails (its answer too: nothing was written); the worker lives on
            parts = encode_message(("error", f"{type(exc).__name__}: {exc}"))
        try:
            send_parts(out, parts)
        except OSError:  # the parent is gone (or gave up on this child)
            return


class ProcessExecutor:
    """The BatchExecutor interface (`run`), carried out by a child process."""

    def __init__(self, cfg, worker: int, build):
        """build(cfg, worker) -> executor runs in the child: a module-level function (the
        spawn start method pickles it by name)."""
        # the child serves one CPU worker in process: no profile to load, no GPU, no children;
        # it pins itself to the worker cores
        self.cpus = cfg.cpu_pipeline.cpus
        in_child = dataclasses.replace(cfg.cpu_pipeline, processes=False, cpus=())
        self.cfg = dataclasses.replace(cfg, cpu_pipeline=in_child, gpu_pipeline=None, policy=type(cfg.policy)())
        self.worker = worker
        self._build = build
        self.batch_timeout_s = batch_timeout_s()
        self._ctx = multiprocessing.get_context("spawn")  # fork would copy the server's threads' locks
        self._proc = None
        self._conn = None
        self._reader: MessageReader | None = None
        self._lifecycle = threading.RLock()  # a start or restart, and a close, one at a time
        self._start()

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_child_main, args=(child, self.cfg, self.worker, self._build, self.cpus),
                                 name=f"hybridgnn-cpu-worker-{self.worker}", daemon=True)
        try:
            with stop_signals_blocked():
                proc.start()  # EAGAIN, ENOMEM: nothing started, nothing to join later
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._proc, self._conn = proc, parent
        try:
            self._reader = MessageReader(socket.socket(fileno=os.dup(parent.fileno())))
            stall = struct.pack("ll", STALL_S, 0)
            self._reader._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
            self._reader._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
            if not parent.poll(START_TIMEOUT_S):
                raise WorkerProcessError(f"CPU worker process {self.worker} did not start within "
                                         f"{START_TIMEOUT_S:.0f} s")
            try:
                kind, detail = self._reader.read()
            except (EOFError, OSError, ValueError, pickle.UnpicklingError):
                proc.join(1.0)
                kind, detail = "error", f"exited with code {proc.exitcode}"
            if kind != "ready":
                raise WorkerProcessError(f"CPU worker process {self.worker} could not start: {detail}")
        except BaseException:  # nothing half-started is left: the child, its socket and their descriptors
            self.close()
            raise

    def run(self, seeds: np.ndarray, timings: StageTimings | None = None) -> BatchResult:
        if not self.running:
            self.restart()
        self.send(seeds)
        # the answer's first bytes, for as long as a batch may take (for ever: None); the rest
        # must then keep coming (the socket's stall limit)
        hung = self._await_answer()
        if hung is not None:
            self.kill()
            raise hung
        try:
            return self.receive(timings)
        except WorkerProcessExited:  # or stalled mid-answer, its stream out of step: the next run starts another
            self.kill()
            raise

    def _await_answer(self) -> WorkerProcessError | None:
        """Wait for the answer's first bytes (None once they come), looking at the child as
        the loop does: the error it is killed with when stopped, deadlocked or past the timeout."""
        if self.batch_timeout_s is None:
            self._conn.poll(None)
            return None
        deadline = time.monotonic() + self.batch_timeout_s
        liveness = Liveness()
        while True:
            step = min(LIVENESS_CHECK_S, deadline - time.monotonic())
            if self._conn.poll(max(step, 0.0)):
                return None
            if time.monotonic() >= deadline:
                return self.hung()
            hung = liveness.observe(self.activity(), step)
            if hung is not None:  # the profiler's one batch fails either way
                return self.stuck(hung.reason)

    @property
    def running(self) -> bool:
        """The child is started and has not exited."""
        return self._proc is not None and self._proc.is_alive()

    def restart(self) -> None:
        """Replace an exited (or killed) child with a new one: seconds, so never on the event
        loop. A close() from another thread (the pipeline's stop) waits for it to end."""
        log.warning("CPU worker process %d is not running; starting it again", self.worker)
        with self._lifecycle:
            self.close()
            self._start()

    def fileno(self) -> int:
        """The pipe's descriptor: readable once the child answers (or exits)."""
        return self._conn.fileno()

    @property
    def connection(self):
        """The current child's end of its socket (a restart replaces it)."""
        return self._conn

    def send(self, seeds: np.ndarray, conn=None) -> None:
        """Hand the child one batch's seed ids (it answers through receive()). conn: the
        connection the batch was meant for (a write that waited on a thread never reaches a
        child started since: that connection is closed by then)."""
        proc = self._proc
        conn = conn if conn is not None else self._conn  # close() from the pipeline's stop may clear it meanwhile
        try:
            conn.send_bytes(np.ascontiguousarray(seeds, dtype=np.int64).tobytes())
        except (AttributeError, OSError, ValueError) as exc:
            raise self._exited(proc) from exc

    def receive(self, timings: StageTimings | None = None) -> BatchResult:
        """The child's answer to the batch sent, waiting for all of it: its outputs, or
        WorkerProcessError (the batch failed there) or WorkerProcessExited (the child is gone)."""
        return self._answer(True, timings)

    def poll_answer(self, timings: StageTimings | None = None) -> BatchResult | None:
        """As receive(), without waiting: None while the answer has not all arrived (what
        has is kept, and the next call reads on). The event loop's way."""
        return self._answer(False, timings)

    @property
    def answer_started(self) -> bool:
        """Part of the child's answer has arrived (poll_answer has the rest to wait for)."""
        reader = self._reader
        return reader is not None and reader.started

    def _answer(self, wait: bool, timings: StageTimings | None) -> BatchResult | None:
        reader, proc = self._reader, self._proc
        try:
            message = reader.read(wait)
            if message is PENDING:
                return None
            kind, payload = message
        except (AttributeError, EOFError, OSError) as exc:
            raise self._exited(proc) from exc
        except Exception as exc:  # an answer that cannot be read: the stream is out of step, the child replaced
            raise WorkerProcessExited(f"CPU worker process {self.worker} sent an answer that could not be read "
                                      f"({type(exc).__name__}: {exc})") from exc
        if kind != "ok":
            raise WorkerProcessError(payload)
        t = timings if timings is not None else StageTimings()
        logits, emb, pred, t.sample_s, t.gather_s, t.compute_s, edges, rows = payload
        return BatchResult(logits=logits, embeddings=emb, predictions=pred, timings=t, sampled_edges=edges,
                           gathered_rows=rows)

    def kill(self) -> None:
        """Kill a hung child and release it (restart() starts the next one)."""
        self.signal_kill()
        self.close()

    def signal_kill(self) -> None:
        """SIGKILL the child and return at once (the event loop's way: reaping it may take a
        while, and restart() does it on a thread)."""
        proc = self._proc
        if proc is not None and proc.pid is not None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def activity(self) -> ChildActivity | None:
        """The child's state and CPU time now (None: unknown, or no child)."""
        proc = self._proc
        return read_activity(proc.pid) if proc is not None and proc.pid is not None else None

    def stuck(self, reason: str) -> WorkerProcessError:
        return WorkerProcessExited(f"CPU worker process {self.worker} {reason} and was killed; "
                                   "it restarts for the next one")

    def hung(self) -> WorkerProcessError:
        return WorkerProcessExited(f"CPU worker process {self.worker} answered no batch within "
                                   f"{self.batch_timeout_s:g} s and was killed; it restarts for the next one")

    def _exited(self, proc) -> WorkerProcessExited:
        if proc is not None:
            proc.join(0.1)  # let the exit code settle
        code = proc.exitcode if proc is not None else None
        return WorkerProcessExited(f"CPU worker process {self.worker} exited (code {code}) during a batch; "
                                   "it restarts for the next one")

    def close(self) -> None:
        """Ask the child to exit and wait for it (killed if it does not within 5 s)."""
        with self._lifecycle:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            try:
                # never waits: a child that stopped reading with the buffer full is killed below
                os.set_blocking(self._conn.fileno(), False)
                self._conn.send_bytes(b"")
            except (OSError, ValueError):
                pass
            self._conn.close()
            self._conn = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._proc is not None:
            self._proc.join(5.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._proc = None
