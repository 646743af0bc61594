"""Serving a model repository: every version its policies choose, over one graph (the
dataset, its workload tables and feature stores are loaded once; each version has its own
weights and precomputed embeddings), kept in step with the directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from hybridgnn.errors import (
    ConfigError,
    Conflict,
    Draining,
    NotFound,
    ServingError,
    brief,
)
from hybridgnn.graph.store import read_meta
from hybridgnn.runtime.resources import embeddings_missing
from hybridgnn.serving.core.engine import open_engine
from hybridgnn.serving.repository.layout import (
    SIGNATURE_ENTRIES,
    UNLOADED,
    RepositoryModel,
    VersionSignature,
    clear_unloaded,
    scan_repository,
    signature,
    version_config,
    version_signature,
)
from hybridgnn.serving.repository.models import Models
from hybridgnn.serving.repository.unloads import record_unload

log = logging.getLogger("hybridgnn.repository")
# A version's precompute runs at this niceness: below serving, which it shares the cores with.
PRECOMPUTE_NICE = 10


class Repository:
    """The served versions of a model repository, kept in step with the directory: load
    (at start, on POST .../load, or when polling finds a change: layout.signature, the
    files each chosen version's load reads, its embedding store's included) builds each
    new or changed version in the background (weights and golden check, stored embeddings
    or a precompute, worker start and warm-up) and then switches to it at once; requests
    already on the old engine finish there, and it is drained and stopped after. A
    version that fails to load leaves what serves in place and is listed UNAVAILABLE
    with why. A model unloaded by the API is marked so in its directory (layout.UNLOADED)
    before the answer: no replica polling the repository serves it, nor does this one
    after a restart, until a load through the API (on any replica) removes the mark."""

    def __init__(self, cfg, stats):
        self.cfg = cfg
        self.stats = stats
        self.models = Models()
        self.base = None  # a serving engine: its graph, tables and feature stores are shared
        self.closing = False  # shutting down: no more loads
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._seen: dict[str, tuple] = {}  # model -> its signature as its last load saw it (and left it)
        self._started: dict[tuple[str, str], VersionSignature] = {}  # (model, version) -> what its engine read
        self._store: str | None = None  # the embedding store every version reads (the dataset's fingerprint)
        self._writing: set[tuple[str, str]] = set()  # versions a poll found their store being written in
        self._unloaded: set[str] = set()  # marked unloaded (UNLOADED) and unloaded here: the poller leaves them alone
        self._kept: set[str] = set()  # marked unloaded but the last model served here: serving on (said once)
        self._retiring: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        self._unreadable: str | None = None  # why the last poll could not read the repository
        self._children: set[asyncio.subprocess.Process] = set()  # precomputes running

    async def start(self) -> Models:
        self._store = await asyncio.to_thread(dataset_store, self.cfg)
        on_disk = await asyncio.to_thread(scan_repository, self.cfg.model_repository, strict=False)
        for name in on_disk:
            try:
                await self.load(name, at_start=True)
            except (Conflict, NotFound) as exc:  # listed UNAVAILABLE with why (or gone since): no other spoiled
                log.error("model %s is not served: %s", name, exc)
        if not self.models.engines():
            marks = [str(Path(self.cfg.model_repository) / n / UNLOADED) for n in sorted(self._unloaded)]
            if self._unloaded >= set(on_disk):
                raise ConfigError(f"every model of repository {self.cfg.model_repository} is marked unloaded (an "
                                  f"unload through the API), so none would be served: delete the mark of each model "
                                  f"to serve: {marks}")
            raise ConfigError(f"no model version of repository {self.cfg.model_repository} can be served: "
                              + "; ".join(f"{n} {v}: {why}" for (n, v), why in self.models.unavailable.items())
                              + (f" (delete the marks {marks} to serve the models unloaded through the API)"
                                 if marks else ""))
        if self.cfg.server.repository_poll_s > 0:
            self._poller = asyncio.create_task(self._poll(), name="repository-poll")
        return self.models

    async def load(self, name: str, *, by_poll: bool = False, at_start: bool = False) -> list[str]:
        """(Re)load model `name` from the repository: start the versions its policy now
        chooses that are not served or whose files changed, then retire the ones it no
        longer chooses. Returns what now serves; NotFound when the repository has no such
        model, Conflict when its config.json cannot be used. A version whose embeddings
        another process is writing is waited for only at start (a replica started beside
        another); a poll or an API load leaves it as it is (_being_written)."""
        if self.closing:
            raise Draining("the server is shutting down; no model loads now")
        async with self._lock:
            on_disk, signatures = await asyncio.to_thread(self._read, name)
            model = on_disk.get(name)
            if model is None:
                raise NotFound(f"the repository has no model {brief(name)}; it has {sorted(on_disk)}")
            if model.unloaded is True and (by_poll or at_start):  # unloaded through the API, here or elsewhere
                self._marked_unloaded(model)
                return self.models.versions(name)
            if by_poll and (name in self._unloaded or self._seen.get(name) == signatures[name]):
                return self.models.versions(name)  # unloaded by the API, or loaded as it is since the poll looked
            if by_poll:
                log.info("repository poll: model %s changed on disk; loading", name)
            # a load through the API: every replica, and this one restarted, serves it again (a mark that
            # cannot be looked at is left: the model's directory cannot be read, and its load says so)
            if model.unloaded:
                try:
                    mark = await asyncio.to_thread(clear_unloaded, model.root)
                except OSError as exc:
                    raise Conflict(
                        f"model {name!r} is not loaded: it was unloaded through the API, and a load must remove "
                        f"the mark {model.root / UNLOADED} from the repository to survive restarts and reach every "
                        f"replica, but it cannot be removed ({exc.strerror or exc}); delete that file where the "
                        "repository can be written, and every replica's poll loads the model") from exc
                log.info("model %s: its unload mark %s is removed; loading it", name, mark)
            self._unloaded.discard(name)
            self._kept.discard(name)
            before = dict(self._seen[name][2]) if name in self._seen else {}  # version -> as the last load saw it
            seen = self._seen[name] = signatures[name]
            for key in [k for k in self.models.unavailable if k[0] == name]:
                del self.models.unavailable[key]
            if model.error is not None:
                self.models.unavailable[(name, "")] = model.error
                raise Conflict(f"model {name!r}: {model.error}")
            if not model.chosen:
                self.models.unavailable[(name, "")] = (f"no version directory matches the version policy (on "
                                                       f"disk: {model.available})")
            served = set(self.models.versions(name))
            files = dict(seen[2])  # version -> its signature
            for version in model.chosen:
                key = (name, str(version))
                if str(version) in served and self._started.get(key) == files[version]:
                    continue
                if by_poll and self._being_written(key, files[version], before.get(version)):
                    continue
                if not at_start and files[version].store_writer:
                    self.models.unavailable[key] = ("its embeddings are being written by another process (a "
                                                    "precompute); the poll loads it once they are complete")
                    continue
                self._writing.discard(key)
                engine, files[version] = await self._start_version(model, version, files[version])
                if engine is None:
                    continue
                old = self.models.get(name, str(version)) if str(version) in served else None
                self.models.add(name, str(version), engine)  # from the next request on
                self._started[key] = files[version]
                if old is not None:
                    self._retire(old, name, str(version), replaced=True)
            # with the store as this load's precomputes left it: their writes are no change
            self._seen[name] = (*seen[:2], tuple((v, files[v]) for v in model.chosen))
            keep = {str(v) for v in model.chosen}
            for version in sorted(served - keep):
                if self.models.versions(name) != [version]:  # never retire the last one serving
                    self._forget(name, version)
                    self._retire(self.models.remove(name, version), name, version)
            return self.models.versions(name)

    def _forget(self, name: str, version: str) -> None:
        """What was kept of a version that stops serving: kept, it grew by a version's file
        stamps (up to SIGNATURE_ENTRIES) for every version a long-running server retired."""
        self._started.pop((name, version), None)
        self._writing.discard((name, version))

    def _read(self, name: str | None = None) -> tuple[dict[str, RepositoryModel], dict[str, tuple]]:
        """(In a worker thread: every disk read of a load or a poll is made off the event
        loop, where a slow or network filesystem stalled every request.) The repository's
        models, and the signatures of model `name`'s files (None: of every model's)."""
        on_disk = scan_repository(self.cfg.model_repository, strict=False)
        return on_disk, {n: signature(m, self._store) for n, m in on_disk.items() if name in (None, n)}

    def _being_written(self, key: tuple[str, str], now: VersionSignature, before: VersionSignature | None) -> bool:
        """(The poll.) Whether another process writes the version's incomplete embedding
        store (`hybridgnn precompute` run on its directory): it holds the store's lock, or,
        since the last load looked at the version, the store changed and nothing else did.
        A load now would start a second precompute, which would wait for the first one,
        and with it every load and poll: for ever if that one was stopped (Ctrl-Z). The
        version stays as it is (serving as loaded, or not), and the poll loads it once
        the store is complete or its writer is gone."""
        if not now.store_writer and (
                before is None or now.store_complete is not False or now.store == before.store
                or (now.files, now.config) != (before.files, before.config)):
            return False
        if key not in self._writing:  # said once, not every poll while it is written
            self._writing.add(key)
            log.info("repository poll: the embeddings of model %s version %s are being written; it is loaded "
                     "once they are complete", *key)
        return True

    async def unload(self, name: str) -> None:
        """Stop serving every version of `name` (their memory is freed once in-flight
        requests finish), once the repository records it (unloads.record_unload): every
        replica polling the repository then unloads it too, and none serves it after a
        restart. Nothing changes when it cannot be recorded (Conflict)."""
        async with self._lock:
            if not self.models.versions(name):
                raise NotFound(f"model {brief(name)} is not loaded; loaded: {self.models.names()}")
            if self.models.names() == [name]:
                raise Conflict(f"model {name!r} is the last one served; load another first")
            await asyncio.to_thread(record_unload, Path(self.cfg.model_repository), name, lambda: self.closing)
            for version in self.models.versions(name):
                self._forget(name, version)
                self._retire(self.models.remove(name, version), name, version)
                # listed as Triton lists it: the index showed nothing of a model it could load again
                self.models.unavailable[(name, version)] = "unloaded"
            self._unloaded.add(name)
            self._kept.discard(name)

    def _marked_unloaded(self, model: RepositoryModel) -> None:
        """(Holding the lock.) `model` is marked unloaded in the repository (through the API
        of this replica or another, now or before a restart): its versions stop serving and
        it is listed unloaded, as after an unload here. The last model served stays, with a
        warning said once, as _removed keeps it."""
        name = model.name
        versions = self.models.versions(name)
        if versions and self.models.names() == [name]:
            if name not in self._kept:
                self._kept.add(name)
                log.warning("repository: model %s is marked unloaded (%s) but is the last model served: it serves "
                            "on until another is loaded", name, model.root / UNLOADED)
            return
        self._kept.discard(name)
        for key in [k for k in self.models.unavailable if k[0] == name]:
            del self.models.unavailable[key]
        for version in versions:
            self._forget(name, version)
            self._retire(self.models.remove(name, version), name, version)
        for version in versions or [str(v) for v in model.chosen] or [""]:
            self.models.unavailable[(name, version)] = "unloaded"
        self._unloaded.add(name)
        if versions:
            log.info("repository: model %s is marked unloaded (%s); unloading it", name, model.root / UNLOADED)

    def _removed(self, name: str) -> None:
        """(The poll, holding the lock.) Model `name` is gone from the repository: its
        versions stop serving, as an unload would stop them, and what was known of it is
        forgotten (it served on, and counted as a model an unload could not take the last
        of). The last model served stays, with a warning, as unload keeps it."""
        for key in [k for k in self.models.unavailable if k[0] == name]:
            del self.models.unavailable[key]
        self._unloaded.discard(name)
        self._kept.discard(name)
        versions = self.models.versions(name)
        if versions and self.models.names() == [name]:
            if self._seen.pop(name, None) is not None:  # once, not every poll
                log.warning("repository poll: model %s is gone from the repository but is the last model "
                            "served: it serves on until another is loaded", name)
            return
        self._seen.pop(name, None)
        for version in versions:
            self._forget(name, version)
            self._retire(self.models.remove(name, version), name, version)
        if versions:
            log.info("repository poll: model %s is gone from the repository; unloading it", name)

    async def _precompute(self, cfg) -> bool:
        """Precompute a version's embeddings when it has none for this dataset (a model
        dropped in without them); True if it ran. It runs in a child process at lower CPU
        priority (PRECOMPUTE_NICE), so serving keeps its cores and its GIL, and the server's
        stop ends it (a precompute resumes where it stopped). ConfigError with the child's
        last lines when it fails."""
        graph = self.base.graph if self.base is not None else None
        if not await asyncio.to_thread(embeddings_missing, cfg, graph):
            return False
        log.info("precomputing the embeddings of %s in a child process (nice %d)", cfg.model_dir, PRECOMPUTE_NICE)
        argv = ["precompute", "--dataset", str(cfg.dataset_dir), "--model", str(cfg.model_dir)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hybridgnn.cli.child", str(PRECOMPUTE_NICE), str(os.getpid()), *argv,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "TQDM_DISABLE": "1"})
        self._children.add(proc)
        tail = b""  # the end of what it said: a failure's reason (bounded)
        try:
            while chunk := await proc.stderr.read(1 << 16):
                tail = (tail + chunk)[-4096:]
            code = await proc.wait()
        finally:
            if proc.returncode is None:  # this load was cancelled: the child goes with it
                proc.kill()
                await proc.wait()
            self._children.discard(proc)
        if self.closing:
            raise Draining("the server began shutting down while the version was precomputed")
        if code != 0:
            said = [x.strip() for x in tail.decode(errors="replace").splitlines() if x.strip()][-3:]
            raise ConfigError(f"precomputing the embeddings of {cfg.model_dir} failed (exit {code}): "
                              + (" / ".join(said) or "no output"))
        return True

    async def _start_version(self, model: RepositoryModel, version: int,
                             files: VersionSignature) -> tuple[object | None, VersionSignature]:
        """A started engine for the version, or None (logged and listed unavailable); and
        files, the version's signature taken before, with its embedding store as this load
        left it when it ran a precompute (_own_writes)."""
        t0 = time.perf_counter()
        if files.truncated:
            log.warning("model %s version %d holds more than %d files and directories: a change only to those "
                        "past them is not seen", model.name, version, SIGNATURE_ENTRIES)
        precomputing = False
        try:
            cfg = await asyncio.to_thread(version_config, self.cfg, model, version)  # reads its config.json
            precomputing = True
            if await self._precompute(cfg):
                log.info("precomputed the embeddings of %s", cfg.model_dir)
                files = await self._own_writes(model, version, files)
            precomputing = False
            stats = self.stats.for_model(model.name, str(version)) if self.stats is not None else None
            engine = await open_engine(cfg, stats, version=str(version), share_with=self.base)
            if self.closing:
                await asyncio.shield(engine.stop())
                raise Draining("the server began shutting down while the version loaded")
        except Exception as exc:
            if precomputing:  # a failed precompute leaves part of a store: written here, not a change
                files = await self._own_writes(model, version, files)
            log.error("model %s version %d is not served: %s", model.name, version, exc,
                      exc_info=not isinstance(exc, (ConfigError, ServingError, OSError, ValueError, KeyError)))
            self.models.unavailable[(model.name, str(version))] = str(exc)
            return None, files
        self.base = self.base or engine
        log.info("model %s version %d ready in %.2fs (%s)", model.name, version, time.perf_counter() - t0,
                 model.version_dir(version))
        return engine, files

    async def _own_writes(self, model: RepositoryModel, version: int, files: VersionSignature) -> VersionSignature:
        """files with the version's embedding store as it is now. What this load's precompute
        wrote is what the engine it starts reads, not a change for the next poll to load
        again: a reload after it would read the same files, and after a failed precompute
        (which leaves part of a store) every poll would load, precompute and fail again,
        for ever. The version's other files keep the stamps taken before the precompute:
        a model.pt replaced meanwhile is still a change."""
        now = await asyncio.to_thread(version_signature, model, version, self._store)
        return files._replace(store=now.store, store_complete=now.store_complete,
                              truncated=files.truncated or now.truncated, store_writer=now.store_writer)

    def _retire(self, engine, name: str, version: str, replaced: bool = False) -> None:
        if engine is self.base:  # the shared stores live on in the others; a serving engine is the base now
            self.base = next(iter(self.models.engines()), None)

        async def retire() -> None:
            try:
                await engine.drain(self.cfg.server.drain_timeout_s)
                await engine.stop()
            except Exception:  # no one awaits this task: say it here
                log.exception("unloading model %s version %s failed", name, version)
                return
            if self.stats is not None and version not in self.models.versions(name):  # not loaded again meanwhile
                self.stats.forget_model(name, version)
            # replaced: the version serves on from its new copy (its files changed)
            log.info("model %s version %s %s", name, version,
                     "unloaded" if not replaced else "serves from its new files; the old copy is unloaded")

        task = asyncio.create_task(retire(), name=f"retire-{name}-{version}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.server.repository_poll_s)
            try:
                for name in await self._changes():
                    try:
                        await self.load(name, by_poll=True)
                    except ServingError as exc:
                        log.warning("repository poll: model %s: %s", name, exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # a directory changing under the scan, say: try again next time
                log.exception("repository poll failed; trying again in %.1fs", self.cfg.server.repository_poll_s)

    async def _changes(self) -> list[str]:
        """(The poll.) Reads the repository in a worker thread, stops serving the models gone
        from it and returns those whose files changed since their last load (each load reads
        them again). It holds the lock loads and unloads take, from the read to what it
        decides: a load or unload never interleaves with it, so none applies what it read
        out of order with another."""
        async with self._lock:
            if self.closing:
                return []
            try:
                on_disk, signatures = await asyncio.to_thread(self._read)
            except (ConfigError, OSError) as exc:
                # a volume remounted or a directory swapped, say: what serves stays; said once
                # per cause, not a traceback per poll
                if str(exc) != self._unreadable:
                    log.warning("repository poll: %s; serving what is loaded, looking again every %.1fs", exc,
                                self.cfg.server.repository_poll_s)
                self._unreadable = str(exc)
                return []
            if self._unreadable is not None:
                log.info("repository poll: the repository is readable again")
                self._unreadable = None
            for name in sorted((set(self.models.names()) | set(self._seen)) - set(on_disk)):
                self._removed(name)
            for name, model in on_disk.items():  # marks another replica's unloads and loads wrote or removed
                if model.unloaded is None:  # its directory cannot be read now: as it was (a load says why)
                    continue
                if model.unloaded:
                    if name not in self._unloaded:
                        self._marked_unloaded(model)
                    continue
                self._kept.discard(name)
                if name in self._unloaded:
                    log.info("repository poll: model %s is no longer marked unloaded (%s is gone: a load through "
                             "the API of another replica, or deleted); loading it", name, model.root / UNLOADED)
                    self._unloaded.discard(name)
                    self._seen.pop(name, None)  # loaded whatever its files are
            return [name for name, seen in signatures.items() if self._seen.get(name) != seen
                    and name not in self._unloaded]

    def begin_shutdown(self) -> None:
        """No more loads; the poller stops."""
        self.closing = True
        if self._poller is not None:
            self._poller.cancel()
        for proc in self._children:  # a precompute resumes where it stopped, next time
            if proc.returncode is None:
                proc.terminate()

    async def stop(self) -> None:
        self.begin_shutdown()
        if self._poller is not None:
            await asyncio.gather(self._poller, return_exceptions=True)
        async with self._lock:  # a load in flight finishes (and, seeing `closing`, discards its engine)
            pass
        for task in list(self._retiring):
            await asyncio.gather(task, return_exceptions=True)


def dataset_store(cfg) -> str | None:
    """The embedding store every version of the repository reads: embeddings/<the served
    dataset's fingerprint>/ (None, all of embeddings/, when its meta.json cannot be read:
    the load then says why)."""
    dataset = getattr(cfg, "dataset_dir", None)
    if dataset is None:
        return None
    try:
        return str(read_meta(Path(dataset)).get("fingerprint", ""))
    except (ConfigError, OSError):
        return None


async def open_repository(cfg, stats) -> Repository:
    """A started Repository: every version the policies choose, serving."""
    repository = Repository(cfg, stats)
    await repository.start()
    return repository
