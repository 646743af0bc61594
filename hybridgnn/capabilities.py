"""What this process can use, detected once (CUDA, uvloop, cores), and the gate on its
device calls that lets a CUDA graph capture run alone (DEVICE_GATE).

HAS_CUDA is computed on first access, not at import: the CLI reads CPU_COUNT from here
to parse its flags, and `--help` must not wait for torch to load."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

HAS_UVLOOP: bool = importlib.util.find_spec("uvloop") is not None


def own_usage() -> tuple[float, int]:
    """This process's CPU time so far (user + system, seconds) and resident memory (bytes;
    0 where /proc cannot say)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = 0
    return ru.ru_utime + ru.ru_stime, rss


def allowed_cores() -> set[int]:
    """The cores this process may run on now (its affinity; all of them where it cannot be read)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


CPU_COUNT: int = len(allowed_cores())


def cpu_quota_cores(cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """The cores a CPU quota grants this process's cgroup (a container's CPU limit:
    cgroup v2 cpu.max, else v1 cfs_quota/cfs_period), or None without a quota."""
    import math

    try:
        with open(f"{cgroup_root}/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{cgroup_root}/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open(f"{cgroup_root}/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 or math.isinf(quota / period) else quota / period


def usable_cores() -> int:
    """Cores this process can keep busy: its affinity, lowered to a container's CPU quota."""
    quota = cpu_quota_cores()
    return CPU_COUNT if quota is None else max(1, min(CPU_COUNT, int(quota)))


# Rank processes one machine may start per core (precompute --nprocs, serve --partitions):
# each is a whole process with its own torch (hundreds of MB), and ranks past the cores
# only take turns.
RANKS_PER_CORE = 4


def check_local_ranks(flag: str, ranks: int, cores: int, elsewhere: str) -> None:
    """ValueError (one line, naming the flag) when `ranks` processes are more than this
    machine's `cores` can run; `elsewhere` says how to run them across machines."""
    if ranks > RANKS_PER_CORE * cores:
        raise ValueError(f"{flag} {ranks}: more ranks than this machine's {cores} cores can run (at most "
                         f"{RANKS_PER_CORE * cores}); across machines, {elsewhere}")


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (imports torch; cached as HAS_CUDA)."""
    if "HAS_CUDA" not in globals():
        import torch

        globals()["HAS_CUDA"] = bool(torch.cuda.is_available())
    return globals()["HAS_CUDA"]


def __getattr__(name: str):
    if name == "HAS_CUDA":
        return has_cuda()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def raise_open_file_limit() -> int:
    """Lift the soft open-files limit to the hard one: a server (or load generator) holds a
    socket per connection, and 1024 runs out under overload. Returns the limit in force."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        return soft
    except (ImportError, ValueError, OSError):
        return -1


def write_replacing(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) to a hidden file beside `path`, then rename it over `path`: a reader, or
    a process that has the old file memory-mapped (a serving engine), sees the old file or
    the new one whole. Rewriting in place truncates the pages under such a map, and the
    mapping process dies of SIGBUS. The temporary keeps path's suffix (np.save adds .npy
    to a name without it) and is removed when write fails. A link at `path` is replaced
    by the new file and what it pointed to is left as it was: writing through it would
    rewrite a file outside the directory written (another model version's weights, a
    shared dataset's table), perhaps one this user may not write. A link above `path` (a
    directory) is followed."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the data before the rename that names it, on a crash too
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_directory(path: Path) -> None:
    """fsync a directory: a file renamed into it (write_replacing) or removed from it stays
    so after a crash or a power cut only once its directory is on disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive(lock_path: Path, waiting: str, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold an exclusive lock on lock_path (made if missing) for the block: one writer of
    what it guards at a time, across processes. A process that must wait logs `waiting`
    once. The lock goes with its holder, even one killed with -9 (flock). A lock file this
    process may not write (another user's) is locked through a read-only descriptor. Where
    the lock file can be neither made nor opened (a read-only directory: nobody writes
    there) or the filesystem takes no lock, the block runs without it. Yields whether it
    waited for another holder (who may have done the work meanwhile). timeout_s: wait at
    most that long (TimeoutError, the block not run): a holder stopped (SIGSTOP, a frozen
    container) or another process's `flock` otherwise held this one up for as long."""
    import errno
    import fcntl
    import logging

    lock_path = Path(lock_path)
    refused = (errno.EROFS, errno.EACCES, errno.EPERM)
    fd = None
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in refused:
            raise
    if fd is None:
        try:
            # a lock file another user made (0644): flock needs no write access, and one
            # who can write what it guards must still wait for that user's writer
            fd = os.open(lock_path, os.O_RDONLY)
        except OSError as exc:
            if exc.errno not in (*refused, errno.ENOENT):
                raise
    if fd is None:  # outside the handlers: the block's own errors are not chained to these
        yield False
        return
    waited = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("hybridgnn").info("%s", waiting)
            if timeout_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                _flock_within(fd, lock_path, timeout_s)
            waited = True
        except OSError as exc:
            # NFS takes an exclusive lock only on a file open for writing (EBADF); a mount
            # without a lock manager takes none (ENOLCK)
            if exc.errno not in (errno.EBADF, errno.ENOLCK):
                raise
            logging.getLogger("hybridgnn").warning("cannot lock %s (%s): running without the lock", lock_path,
                                                   os.strerror(exc.errno))
        yield waited
    finally:
        os.close(fd)  # releases the lock


def _flock_within(fd: int, lock_path: Path, timeout_s: float) -> None:
    """flock(fd, LOCK_EX), tried until timeout_s passes (TimeoutError then)."""
    import fcntl
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{lock_path} is held by another process for more than {timeout_s:g}s") from None
            time.sleep(0.02)  # the retry interval, bounded by the deadline


def save_array(path: Path, array) -> None:
    """np.save by write_replacing."""
    import numpy as np

    write_replacing(path, lambda tmp: np.save(tmp, array))


_DESCRIPTOR_RESERVE = 256  # kept free for files, the engine's pipes and the listeners


def connection_limit(wanted: int, listeners: int = 1, flag: str = "--max-connections") -> int:
    """`wanted`, lowered to one listener's share of what the process's open-files limit
    leaves: HTTP and gRPC in one process each take a share, so together they hold no more
    sockets than it may open. Says so in one line when it lowers it."""
    import logging
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    from hybridgnn.config import ServerConfig

    room = max(16, (soft - _DESCRIPTOR_RESERVE) // max(1, listeners))
    if wanted > room:
        # a warning for a limit asked for; the default lowered is only said (a warning at
        # every start, for a value no one chose, taught users to skip warnings)
        logging.getLogger("hybridgnn.serve").log(
            logging.INFO if wanted == ServerConfig.max_connections else logging.WARNING,
            "%s %d lowered to %d: the process may open %d files%s", flag, wanted, room, soft,
            f", shared by {listeners} listeners" if listeners > 1 else "")
    return min(wanted, room)


def keep_off_cores(cores) -> set[int] | None:
    """Move this process (every thread, and what it starts later) off `cores`, onto the
    other cores it may use. Returns the cores it now keeps to, or None when nothing
    changed: no cores given, none would remain, or the platform cannot pin."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return None
    rest = allowed_cores() - set(cores)
    if not rest:
        return None
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, rest)
        except OSError:  # a thread that ended meanwhile
            pass
    return rest


def _thread_ids() -> list[int]:
    """This process's OS thread ids (Linux; elsewhere just the process)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def file_identity(path) -> list[int]:
    """[device, inode, size, modification ns] of a file: another file, or this one rewritten
    since, differs."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def freeze_startup_heap() -> None:
    """Move every object alive now (imported modules, torch, the model, the graph's
    wrappers) out of the garbage collector's reach. Call once, when start-up is done:
    otherwise each full collection walks those millions of objects and stalls the event
    loop for 100+ ms, which shows up directly as p99 latency."""
    import gc

    gc.collect()
    gc.freeze()


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-visible name (Linux, at most 15 bytes), so `top -H`
    and /proc/<pid>/task/*/comm tell the event loop from the pipeline workers."""
    c = libc()
    if c is not None and hasattr(c, "prctl"):  # elsewhere: names are cosmetic
        c.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def libc():
    """The C library (ctypes), or None where it cannot be loaded."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def die_with_parent(parent: int, c=None) -> None:
    """Have the kernel send this process SIGTERM when its parent exits (Linux; elsewhere a
    no-op), so a child is not left running by a parent killed with -9 or stopped before
    it could stop its children; exits at once when `parent` (its pid when it started this
    process) is gone already. c: libc() loaded already (between fork and exec, loading it
    could wait for a lock another thread of the parent held)."""
    c = c if c is not None else libc()
    if c is None or not hasattr(c, "prctl"):
        return
    c.prctl(1, 15, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGTERM
    if os.getppid() != parent:  # gone before the prctl took hold
        os._exit(1)


def private_run_dir(kind: str) -> str:
    """A new directory only this user can enter (0700) for a server's sockets and files,
    named hybridgnn-<kind>-<pid>-*, after removing this user's directories of that kind
    whose process is gone: one killed with -9 never removed its own, and they gathered
    in the temporary directory for ever."""
    import re
    import shutil
    import tempfile

    root, pattern = tempfile.gettempdir(), re.compile(rf"hybridgnn-{re.escape(kind)}-(\d+)-")
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        m = pattern.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"hybridgnn-{kind}-{os.getpid()}-")


@contextlib.contextmanager
def temporary_run_dir(kind: str) -> Iterator[str]:
    """private_run_dir for the block, removed after it (and, if this process is killed
    with -9, by the next one of its kind)."""
    import shutil

    path = private_run_dir(kind)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def locked_elsewhere(lock_path: Path) -> bool:
    """Whether another holder has lock_path locked (exclusive's writer, in any process):
    probed with a shared lock, given back at once. False when the file is absent or takes
    no lock (nobody can hold it then)."""
    import fcntl

    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # and with it the probe's own lock
    return False


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def run_async(coro):
    """Run a coroutine to completion on uvloop when present (cheaper per request), else asyncio."""
    if HAS_UVLOOP:
        import uvloop

        return uvloop.run(coro)
    import asyncio

    return asyncio.run(coro)


def describe() -> dict:
    """A small, JSON-friendly description of the machine for benchmark and profile reports."""
    import platform

    import torch

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": CPU_COUNT,
        "torch": torch.__version__,
        "cuda": has_cuda(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if info["cuda"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def describe_line() -> str:
    d = describe()
    gpus = ", ".join(d.get("gpus", [])) or "no GPU"
    return f"{d['cpu']} ({d['cpu_count']} cores), {gpus}, torch {d['torch']}"


class DeviceGate:
    """Device work (many threads at once) against a CUDA graph capture (alone): on an
    H200 a capture in thread-local mode still failed while another thread launched. A thread
    inside work() may capture: its own hold is set aside meanwhile. Captures wait for the
    threads inside work() to leave and keep new ones out (a waiting capture goes first),
    so nothing else in the process calls into CUDA while one records."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._working = 0  # threads inside work()
        self._capturing = False
        self._waiting = 0  # captures waiting for the working threads to leave
        self._depth = threading.local()

    @contextlib.contextmanager
    def work(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                while self._capturing or self._waiting:
                    self._cond.wait()
                self._working += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                with self._cond:
                    self._working -= 1
                    if not self._working:
                        self._cond.notify_all()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        held = getattr(self._depth, "n", 0) > 0
        with self._cond:
            if held:
                self._working -= 1
            self._waiting += 1
            try:
                while self._capturing or self._working:
                    self._cond.wait()
            except BaseException:  # interrupted while waiting: as if it never asked
                self._waiting -= 1
                if held:
                    self._working += 1
                self._cond.notify_all()
                raise
            self._waiting -= 1
            self._capturing = True
        try:
            yield
        finally:
            with self._cond:
                self._capturing = False
                if held:
                    self._working += 1
                self._cond.notify_all()

    @property
    def working(self) -> int:
        """Threads inside work() now (tests)."""
        return self._working


DEVICE_GATE = DeviceGate()  # one per process: device work (executors, cache refreshes, setup) and captures
