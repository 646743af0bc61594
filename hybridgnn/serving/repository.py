"""A model repository in Triton's layout, and the registry of the models a server serves.

    <repository>/<model name>/<version>/     a model directory, as `hybridgnn model save`
                                             (save_model) writes it; versions are positive
                                             integers
    <repository>/<model name>/config.json    optional: {"version_policy": {"latest":
                                             {"num_versions": N}} | {"specific":
                                             {"versions": [..]}} | {"all": {}},
                                             "fanouts": [..]}

Every model and version is served over one graph: the dataset, its workload tables and
feature stores are loaded once (runtime.Resources shares them); each version has its own
weights and precomputed embeddings. A request names a model and, optionally, a version
(default: the highest version loaded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from hybridgnn.config import parse_fanouts
from hybridgnn.errors import ConfigError, NotFound, brief

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

    @property
    def chosen(self) -> list[int]:
        return self.policy.choose(self.available)

    def version_dir(self, version: int) -> Path:
        return self.root / str(version)


def scan_repository(root: Path) -> dict[str, RepositoryModel]:
    """The models under `root` (ConfigError for a repository that is not one)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a directory")
    models: dict[str, RepositoryModel] = {}
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
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
        models[path.name] = RepositoryModel(path.name, path, versions,
                                            VersionPolicy.parse(spec.get("version_policy"), str(cfg_path)), fanouts)
    if not models:
        raise ConfigError(f"model repository {root} holds no models (expected <name>/<version>/ directories)")
    return models


class Models:
    """The engines a server serves, by model name and version (strings, as requests name
    them). A request without a version gets the highest one."""

    def __init__(self):
        self._engines: dict[str, dict[str, object]] = {}
        self.unavailable: dict[tuple[str, str], str] = {}  # (name, version) -> why it is not served

    def add(self, name: str, version: str, engine) -> None:
        self._engines.setdefault(name, {})[version] = engine

    def get(self, name: str, version: str | None = None):
        """The engine of model `name` (version: that one, else the highest); NotFound
        naming what this server serves."""
        versions = self._engines.get(name)
        if not versions:
            raise NotFound(f"unknown model {brief(name)}; this server serves {sorted(self._engines)}")
        if version is None:
            return versions[max(versions, key=_version_key)]
        engine = versions.get(version)
        if engine is None:
            raise NotFound(f"model {name!r} has no version {brief(version)}; versions: "
                           f"{sorted(versions, key=_version_key)}")
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
    return dataclasses.replace(cfg, model_dir=vdir, sampling=dataclasses.replace(cfg.sampling, fanouts=fanouts),
                               server=dataclasses.replace(cfg.server, model_name=model.name))


async def open_repository(cfg, stats) -> Models:
    """Start an engine for every model version the repository's policies choose, the
    first one loading the graph and the others sharing it. A version that cannot be
    served (unreadable, a failed golden check, a feature width that does not fit) is
    logged and listed as unavailable with why; the server starts if any version can."""
    from hybridgnn.serving.engine import Engine

    models = Models()
    base = None
    for m in scan_repository(cfg.model_repository).values():
        if not m.chosen:
            models.unavailable[(m.name, "")] = (f"no version directory matches the version policy (on disk: "
                                                f"{m.available})")
        for version in m.chosen:
            try:
                engine = Engine(version_config(cfg, m, version), stats, base=base.resources if base else None)
                await engine.start()
            except (ConfigError, OSError, ValueError, KeyError) as exc:
                log.error("model %s version %d is not served: %s", m.name, version, exc)
                models.unavailable[(m.name, str(version))] = str(exc)
                continue
            base = base or engine
            models.add(m.name, str(version), engine)
            log.info("model %s version %d ready (%s)", m.name, version, m.version_dir(version))
    if not models.engines():
        raise ConfigError(f"no model version of repository {cfg.model_repository} can be served: "
                          + "; ".join(f"{n} {v}: {why}" for (n, v), why in models.unavailable.items()))
    return models
