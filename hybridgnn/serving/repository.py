"""A model repository in Triton's layout, and the registry of the models a server serves.

    <repository>/<model name>/<version>/     a model directory, as `hybridgnn model save`
                                             (save_model) writes it; versions are positive
                                             integers
    <repository>/<model name>/config.json    optional: {"version_policy": {"latest":
                                             {"num_versions": N}} | {"specific":
                                             {"versions": [..]}} | {"all": {}},
                                             "fanouts": [..], "outputs": ["logits", ..]}

Every model and version is served over one graph: the dataset, its workload tables and
feature stores are loaded once (runtime.Resources shares them); each version has its own
weights and precomputed embeddings. A request names a model and, optionally, a version
(default: the highest version loaded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridgnn.config import parse_fanouts
from hybridgnn.errors import (
    ConfigError,
    Conflict,
    Draining,
    NotFound,
    ServingError,
    brief,
)

log = logging.getLogger("hybridgnn.repository")

CONFIG = "config.json"


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model to serve: the newest `latest`, the `specific` ones, or all."""

    latest: int | None = 1
    specific: tuple[int, ...] = ()

    @classmethod
    def parse(cls, spec: dict | None, where: str) -> VersionPolicy:
        if spec is None:
            return cls()
        if not isinstance(spec, dict) or len(spec) != 1:
            raise ConfigError(f"{where}: version_policy must be one of {{'latest': {{'num_versions': N}}}}, "
                              "{'specific': {'versions': [..]}} or {'all': {}}")
        (kind, body), = spec.items()
        body = body or {}
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: version_policy.{kind} must be an object, got {brief(body)}")
        if kind == "all":
            return cls(latest=None)
        if kind == "latest":
            n = body.get("num_versions", 1)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"{where}: version_policy.latest.num_versions must be an integer >= 1, got {brief(n)}")
            return cls(latest=n)
        if kind == "specific":
            versions = body.get("versions")
            if (not isinstance(versions, list) or not versions
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in versions)):
                raise ConfigError(f"{where}: version_policy.specific.versions must be a list of positive integers")
            return cls(latest=None, specific=tuple(sorted(set(versions))))
        raise ConfigError(f"{where}: unknown version_policy {brief(kind)} (latest, specific or all)")

    def choose(self, available: list[int]) -> list[int]:
        if self.specific:
            return [v for v in available if v in self.specific]
        if self.latest is None:
            return list(available)
        return list(available)[-self.latest:]


@dataclass
class RepositoryModel:
    """One model of the repository: its versions on disk and what config.json says."""

    name: str
    root: Path
    available: list[int]
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    fanouts: tuple[int, ...] | None = None
    outputs: tuple[str, ...] | None = None  # what a request naming no outputs gets (None: all)
    error: str | None = None  # why its config.json cannot be used (then no version is chosen)

    @property
    def chosen(self) -> list[int]:
        return [] if self.error is not None else self.policy.choose(self.available)

    def version_dir(self, version: int) -> Path:
        return self.root / str(version)


def scan_repository(root: Path, *, strict: bool = True) -> dict[str, RepositoryModel]:
    """The models under `root` (ConfigError for a repository that is not one). strict:
    a model with an unusable config.json is a ConfigError too; else it is listed with
    its error (and no version chosen), so one bad model does not stop the others."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a directory")
    models: dict[str, RepositoryModel] = {}
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
        try:
            models[path.name] = _read_model(path)
        except (ConfigError, OSError) as exc:
            if strict:
                raise ConfigError(str(exc)) from exc
            models[path.name] = RepositoryModel(path.name, path, [], error=str(exc))
    if not models:
        raise ConfigError(f"model repository {root} holds no models (expected <name>/<version>/ directories)")
    return models


def _read_model(path: Path) -> RepositoryModel:
    versions = sorted(int(p.name) for p in path.iterdir()
                      if p.is_dir() and p.name.isdigit() and p.name.isascii() and int(p.name) > 0)
    cfg_path = path / CONFIG
    spec: dict = {}
    if cfg_path.is_file():
        try:
            spec = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{cfg_path}: not readable JSON: {exc}") from exc
        if not isinstance(spec, dict):
            raise ConfigError(f"{cfg_path}: must be a JSON object")
    fanouts = None
    if spec.get("fanouts") is not None:
        try:
            fanouts = parse_fanouts(spec["fanouts"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{cfg_path}: fanouts: {exc}") from exc
    outputs = spec.get("outputs")
    if outputs is not None:
        known = ("logits", "embeddings", "predictions")
        if not isinstance(outputs, list) or not outputs or not all(o in known for o in outputs):
            raise ConfigError(f"{cfg_path}: outputs must be a non-empty list of {list(known)}")
        outputs = tuple(outputs)
    return RepositoryModel(path.name, path, versions, VersionPolicy.parse(spec.get("version_policy"), str(cfg_path)),
                           fanouts, outputs)


class Models:
    """The engines a server serves, by model name and version (strings, as requests name
    them). A request without a version gets the highest one."""

    def __init__(self):
        self._engines: dict[str, dict[str, object]] = {}
        self._highest: dict[str, object] = {}  # name -> its highest version's engine (what most requests get)
        self.unavailable: dict[tuple[str, str], str] = {}  # (name, version) -> why it is not served

    def add(self, name: str, version: str, engine) -> None:
        self._engines.setdefault(name, {})[version] = engine
        self._note_highest(name)

    def _note_highest(self, name: str) -> None:
        versions = self._engines.get(name)
        if versions:
            self._highest[name] = versions[max(versions, key=_version_key)]
        else:
            self._highest.pop(name, None)

    def get(self, name: str, version: str | None = None):
        """The engine of model `name` (version: that one, else the highest); NotFound
        naming what this server serves."""
        if version is None:
            engine = self._highest.get(name)
            if engine is not None:
                return engine
        versions = self._engines.get(name)
        if not versions:
            raise NotFound(f"unknown model {brief(name)}; this server serves {sorted(self._engines)}")
        engine = versions.get(version)
        if engine is None:
            raise NotFound(f"model {name!r} has no version {brief(version)}; versions: "
                           f"{sorted(versions, key=_version_key)}")
        return engine

    def remove(self, name: str, version: str):
        """Stop routing to (name, version); returns its engine."""
        engine = self._engines[name].pop(version)
        if not self._engines[name]:
            del self._engines[name]
        self._note_highest(name)
        return engine

    def versions(self, name: str) -> list[str]:
        return sorted(self._engines.get(name, {}), key=_version_key)

    def names(self) -> list[str]:
        return sorted(self._engines)

    def engines(self) -> list:
        return [e for versions in self._engines.values() for e in versions.values()]

    def items(self):
        """(name, version, engine), in name then version order."""
        for name in self.names():
            for version in self.versions(name):
                yield name, version, self._engines[name][version]


def _version_key(v: str) -> tuple[int, str]:
    return (int(v), v) if v.isdigit() else (-1, v)


def version_config(cfg, model: RepositoryModel, version: int):
    """The serve configuration of one model version: its directory, its name in requests,
    and its fanouts (config.json's, else those it was saved with)."""
    from hybridgnn.models.checkpoint import read_config

    vdir = model.version_dir(version)
    fanouts = model.fanouts
    if fanouts is None:
        saved = read_config(vdir)
        fanouts = tuple(saved.get("fanouts") or cfg.sampling.fanouts)
    # The update token guards the repository's load/unload API; a repository's versions
    # take no graph updates.
    return dataclasses.replace(cfg, model_dir=vdir, sampling=dataclasses.replace(cfg.sampling, fanouts=fanouts),
                               server=dataclasses.replace(cfg.server, model_name=model.name,
                                                          default_outputs=model.outputs),
                               updates=dataclasses.replace(cfg.updates, token=None))


class Repository:
    """The served versions of a model repository, kept in step with the directory: load
    (at start, on POST .../load, or when polling finds a change) builds each new or
    changed version in the background (weights and golden check, stored embeddings or a
    precompute, worker start and warm-up) and then switches to it at once; requests
    already on the old engine finish there, and it is drained and stopped after. A
    version that fails to load leaves what serves in place and is listed UNAVAILABLE
    with why. A model unloaded by the API stays unloaded until loaded by the API."""

    def __init__(self, cfg, stats):
        self.cfg = cfg
        self.stats = stats
        self.models = Models()
        self.base = None  # a serving engine: its graph, tables and feature stores are shared
        self.closing = False  # shutting down: no more loads
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._seen: dict[str, tuple] = {}  # model -> what its directory looked like when last loaded
        self._started: dict[tuple[str, str], tuple] = {}  # (model, version) -> its files when its engine started
        self._unloaded: set[str] = set()  # unloaded by the API: the poller leaves them alone
        self._retiring: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None

    async def start(self) -> Models:
        for name in scan_repository(self.cfg.model_repository, strict=False):
            await self.load(name)
        if not self.models.engines():
            raise ConfigError(f"no model version of repository {self.cfg.model_repository} can be served: "
                              + "; ".join(f"{n} {v}: {why}" for (n, v), why in self.models.unavailable.items()))
        if self.cfg.server.repository_poll_s > 0:
            self._poller = asyncio.create_task(self._poll(), name="repository-poll")
        return self.models

    async def load(self, name: str, *, by_poll: bool = False) -> list[str]:
        """(Re)load model `name` from the repository: start the versions its policy now
        chooses that are not served or whose files changed, then retire the ones it no
        longer chooses. Returns what now serves; NotFound when the repository has no such
        model, Conflict when its config.json cannot be used."""
        if self.closing:
            raise Draining("the server is shutting down; no model loads now", retry_after_s=1.0)
        async with self._lock:
            on_disk = scan_repository(self.cfg.model_repository, strict=False)
            model = on_disk.get(name)
            if model is None:
                raise NotFound(f"the repository has no model {brief(name)}; it has {sorted(on_disk)}")
            if by_poll and name in self._unloaded:
                return self.models.versions(name)
            self._unloaded.discard(name)
            self._seen[name] = _signature(model)
            for key in [k for k in self.models.unavailable if k[0] == name]:
                del self.models.unavailable[key]
            if model.error is not None:
                self.models.unavailable[(name, "")] = model.error
                raise Conflict(f"model {name!r}: {model.error}")
            if not model.chosen:
                self.models.unavailable[(name, "")] = (f"no version directory matches the version policy (on "
                                                       f"disk: {model.available})")
            served = set(self.models.versions(name))
            for version in model.chosen:
                key, files = (name, str(version)), _version_signature(model, version)
                if str(version) in served and self._started.get(key) == files:
                    continue
                engine = await self._start_version(model, version)
                if engine is None:
                    continue
                old = self.models.get(name, str(version)) if str(version) in served else None
                self.models.add(name, str(version), engine)  # from the next request on
                self._started[key] = files
                if old is not None:
                    self._retire(old, name, str(version))
            keep = {str(v) for v in model.chosen}
            for version in sorted(served - keep):
                if self.models.versions(name) != [version]:  # never retire the last one serving
                    self._retire(self.models.remove(name, version), name, version)
            return self.models.versions(name)

    async def unload(self, name: str) -> None:
        """Stop serving every version of `name` (their memory is freed once in-flight
        requests finish)."""
        async with self._lock:
            if not self.models.versions(name):
                raise NotFound(f"model {brief(name)} is not loaded; loaded: {self.models.names()}")
            if self.models.names() == [name]:
                raise Conflict(f"model {name!r} is the last one served; load another first")
            for version in self.models.versions(name):
                self._retire(self.models.remove(name, version), name, version)
            self._unloaded.add(name)

    async def _start_version(self, model: RepositoryModel, version: int):
        """A started engine for the version, or None (logged and listed unavailable)."""
        from hybridgnn.serving.engine import Engine

        t0 = time.perf_counter()
        engine = None
        try:
            cfg = version_config(self.cfg, model, version)
            await _ensure_embeddings(cfg, self.base)
            stats = self.stats.for_model(model.name, str(version)) if self.stats is not None else None
            engine = await asyncio.to_thread(Engine, cfg, stats,
                                             base=self.base.resources if self.base is not None else None)
            engine.model_version = str(version)
            await engine.start()
            if self.closing:
                raise Draining("the server began shutting down while the version loaded")
        except BaseException as exc:
            if engine is not None:  # half started: its workers must not outlive it
                await asyncio.shield(self._discard(engine))
            if not isinstance(exc, Exception):
                raise  # cancelled: shutting down
            log.error("model %s version %d is not served: %s", model.name, version, exc,
                      exc_info=not isinstance(exc, (ConfigError, ServingError, OSError, ValueError, KeyError)))
            self.models.unavailable[(model.name, str(version))] = str(exc)
            return None
        self.base = self.base or engine
        log.info("model %s version %d ready in %.2fs (%s)", model.name, version, time.perf_counter() - t0,
                 model.version_dir(version))
        return engine

    async def _discard(self, engine) -> None:
        if engine is self.base or (self.base is not None and engine.resources is self.base.resources):
            engine.resources._owns_device = False
        try:
            await engine.stop()
        finally:
            engine.stats.unwatch(engine)

    def _retire(self, engine, name: str, version: str) -> None:
        if engine is self.base:  # the shared stores live on in the others; a serving engine is the base now
            engine.resources._owns_device = False
            self.base = next(iter(self.models.engines()), None)

        async def retire() -> None:
            await engine.drain(self.cfg.server.drain_timeout_s)
            await self._discard(engine)
            log.info("model %s version %s unloaded", name, version)

        task = asyncio.create_task(retire(), name=f"retire-{name}-{version}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.server.repository_poll_s)
            try:
                for name, model in scan_repository(self.cfg.model_repository, strict=False).items():
                    if self._seen.get(name) == _signature(model) or name in self._unloaded:
                        continue
                    log.info("repository poll: model %s changed on disk; loading", name)
                    try:
                        await self.load(name, by_poll=True)
                    except ServingError as exc:
                        log.warning("repository poll: model %s: %s", name, exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # a directory changing under the scan, say: try again next time
                log.exception("repository poll failed; trying again in %.1fs", self.cfg.server.repository_poll_s)

    def begin_shutdown(self) -> None:
        """No more loads; the poller stops."""
        self.closing = True
        if self._poller is not None:
            self._poller.cancel()

    async def stop(self) -> None:
        self.begin_shutdown()
        if self._poller is not None:
            await asyncio.gather(self._poller, return_exceptions=True)
        async with self._lock:  # a load in flight finishes (and, seeing `closing`, discards its engine)
            pass
        for task in list(self._retiring):
            await asyncio.gather(task, return_exceptions=True)


def _version_signature(model: RepositoryModel, version: int) -> tuple:
    """What a change to one served version looks like: its files' sizes and mtimes, and
    the model's config.json (fanouts, outputs)."""
    stamps = []
    for path in sorted(model.version_dir(version).glob("*")):
        if path.is_file():
            st = path.stat()
            stamps.append((path.name, st.st_size, st.st_mtime_ns))
    top = model.root / CONFIG
    return tuple(stamps), top.stat().st_mtime_ns if top.is_file() else 0


def _signature(model: RepositoryModel) -> tuple:
    """What a change to a model on disk looks like: its versions' files and its config."""
    return model.error, tuple((v, _version_signature(model, v)) for v in model.available)


async def _ensure_embeddings(cfg, base) -> None:
    """Precompute a version's embeddings when it has none for this dataset (a model
    dropped into the repository without them): in a child process at lower priority, so
    the versions serving meanwhile keep the interpreter and most of the CPU."""
    from hybridgnn.embeddings.store import EmbeddingStore
    from hybridgnn.graph.store import GraphStore

    graph = base.graph if base is not None else await asyncio.to_thread(GraphStore.open, cfg.dataset_dir)
    if EmbeddingStore.open(cfg.model_dir, graph.fingerprint) is not None:
        return
    t0 = time.perf_counter()
    log.info("precomputing the embeddings of %s", cfg.model_dir)
    nice = [shutil.which("nice"), "-n", "10"] if shutil.which("nice") else []  # not preexec_fn: threads run here
    proc = await asyncio.create_subprocess_exec(
        *nice, sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "precompute", "--dataset",
        str(cfg.dataset_dir), "--model", str(cfg.model_dir), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await proc.communicate()
    except BaseException:  # cancelled (shutting down): the child goes too
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise ConfigError(f"precomputing the embeddings of {cfg.model_dir} failed: {lines[-1] if lines else proc.returncode}")
    log.info("precomputed the embeddings of %s in %.1fs", cfg.model_dir, time.perf_counter() - t0)


async def open_repository(cfg, stats) -> Repository:
    """A started Repository: every version the policies choose, serving."""
    repository = Repository(cfg, stats)
    await repository.start()
    return repository
