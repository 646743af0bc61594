"""A model repository in Triton's layout: what is on disk and which versions to serve.

    <repository>/<model name>/<version>/     a model directory, as `hybridgnn model save`
                                             (save_model) writes it; versions are positive
                                             integers
    <repository>/<model name>/config.json    optional: {"version_policy": {"latest":
                                             {"num_versions": N}} | {"specific":
                                             {"versions": [..]}} | {"all": {}},
                                             "fanouts": [..], "outputs": ["logits", ..]}
    <repository>/<model name>/.unloaded      the model was unloaded through the API: no
                                             replica serves it, across restarts, until a
                                             load through the API (or an operator) removes
                                             it (JSON: when, and through what; only its
                                             presence counts)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from hybridgnn.capabilities import fsync_directory, locked_elsewhere, write_replacing
from hybridgnn.config import SMALL_JSON_BYTES, fanouts_for, parse_fanouts, read_json
from hybridgnn.embeddings.store import embeddings_dir, store_lock
from hybridgnn.errors import ConfigError, brief

CONFIG = "config.json"
# The mark of a model unloaded through the API, in its directory: hidden, so the scan takes
# it for no version, and outside every version directory, so no signature sees it (marking
# a model is no change of its files).
UNLOADED = ".unloaded"


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
    # marked unloaded (UNLOADED): no replica serves it; None: the mark cannot be looked at
    # (its directory unreadable now), so whether it is marked is not known
    unloaded: bool | None = False

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
    try:
        if not root.is_dir():
            raise ConfigError(f"model repository {root} is not a directory")
        listing = sorted(root.iterdir())
    except OSError as exc:  # one this server may not read (now): a ConfigError, as one that is gone (not a 500)
        raise ConfigError(f"model repository {root} cannot be read: {exc.strerror or exc}") from exc
    models: dict[str, RepositoryModel] = {}
    for path in listing:
        if not path.is_dir() or path.name.startswith("."):
            continue
        try:
            path.name.encode("utf-8")
        except UnicodeEncodeError:  # bytes no URL or gRPC string names: listed as a name one can read, never served
            shown = os.fsencode(path.name).decode("utf-8", "replace")
            error = f"the directory name {shown!r} is not UTF-8, so no request can name the model: rename it"
            if strict:
                raise ConfigError(f"{root}: {error}") from None
            models.setdefault(shown, RepositoryModel(shown, path, [], error=error, unloaded=is_marked_unloaded(path)))
            continue
        try:
            models[path.name] = _read_model(path)
        except (ConfigError, OSError) as exc:
            if strict:
                raise ConfigError(str(exc)) from exc
            models[path.name] = RepositoryModel(path.name, path, [], error=str(exc))
        models[path.name].unloaded = is_marked_unloaded(path)
    if not models:
        raise ConfigError(f"model repository {root} holds no models (expected <name>/<version>/ directories)")
    return models


def _read_model(path: Path) -> RepositoryModel:
    # "7", not "007": one directory per version number (Triton's layout)
    versions = sorted(int(p.name) for p in path.iterdir()
                      if p.is_dir() and p.name.isdigit() and p.name.isascii() and p.name == str(int(p.name))
                      and int(p.name) > 0)
    cfg_path = path / CONFIG
    spec: dict = {}
    if cfg_path.is_file():
        try:
            spec = read_json(cfg_path, SMALL_JSON_BYTES)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{cfg_path}: {exc}") from exc
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


def is_marked_unloaded(model_root: Path) -> bool | None:
    """Whether the model's directory holds the UNLOADED mark; None when the mark cannot be
    looked at (a stat error other than its absence: a directory unreadable for a while).
    Not known is neither: a poll leaves such a model as it is, so an unload acknowledged
    is not undone by an unreadable directory, nor is a served model unloaded by one."""
    try:
        os.lstat(Path(model_root) / UNLOADED)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return None
    return True


def mark_unloaded(model_root: Path, through: str) -> Path:
    """Record in the repository that the model is unloaded (its UNLOADED file, written
    whole and durably: a temporary, fsynced, renamed, its directory fsynced); OSError, and
    nothing recorded, when that cannot be done. Returns the mark's path."""
    path = Path(model_root) / UNLOADED
    body = json.dumps({"unloaded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unloaded_unix_s": time.time(),
                       "through": through, "host": socket.gethostname(), "pid": os.getpid(),
                       "note": "no replica serves this model while this file is here; load the model through "
                               "the API, or delete this file, to serve it again"}, indent=1) + "\n"
    write_replacing(path, lambda tmp: Path(tmp).write_text(body))
    try:
        fsync_directory(path.parent)
    except OSError:
        path.unlink(missing_ok=True)  # not durable: not recorded at all
        raise
    return path


def clear_unloaded(model_root: Path) -> Path:
    """Remove the model's UNLOADED mark, durably (its directory fsynced); OSError when it
    cannot be removed (then it is still there). Returns the mark's path."""
    path = Path(model_root) / UNLOADED
    path.unlink(missing_ok=True)
    fsync_directory(path.parent)
    return path


# The most directory entries one version's signature looks at (its own files, then its
# embedding store's): a store holds a few files per layer (per node type), far fewer. Past
# it the walk stops and the signature says so (truncated): a change only among the
# entries past the cap is not seen by a poll (a load through the API reads it).
SIGNATURE_ENTRIES = 4096


class VersionSignature(NamedTuple):
    """What a change to one version looks like: equal signatures, nothing its load reads
    changed. Each file is stamped (name, size, mtime_ns, inode): a file replaced by a
    rename changes its inode even when size and mtime are the same."""

    files: tuple  # the version directory's own files (config.json, model.pt, golden.pt, ..)
    store: tuple  # its embedding store's files, by their path under the store, recursively
    config: tuple  # the model's config.json: (size, mtime_ns, inode), () when it has none
    store_complete: bool | None = None  # the store's state.json says complete (None: no store)
    truncated: bool = False  # the walk stopped at SIGNATURE_ENTRIES
    # a process holds the store's lock (a precompute writing it), looked at while it is
    # not complete: its release is a change too, as when the writer was killed
    store_writer: bool = False


def version_signature(model: RepositoryModel, version: int, store: str | None = None) -> VersionSignature:
    """The signature of the files a load of the version reads: the version directory's
    files, its embedding store's (embeddings/<store>/, store: the served dataset's
    fingerprint; all of embeddings/ when None), walked depth first, at most
    SIGNATURE_ENTRIES entries in all, and the model's config.json."""
    vdir = model.version_dir(version)
    budget = [SIGNATURE_ENTRIES]
    files, truncated = _stamps(vdir, budget, recurse=False)
    root = embeddings_dir(vdir, store) if store is not None else vdir / "embeddings"
    stamps, more = ((), True) if truncated else _stamps(root, budget, recurse=True)
    complete = None
    if stamps and store is not None:
        try:
            state = read_json(root / "state.json", SMALL_JSON_BYTES)
        except (OSError, ValueError):  # absent, or being replaced: not complete now
            state = None
        complete = isinstance(state, dict) and state.get("complete") is True
    writer = store is not None and complete is not True and locked_elsewhere(store_lock(root))
    try:
        top = _stat(model.root / CONFIG)
    except OSError as exc:  # a link to itself, say: the load says why; stamped, not raised out of the poll
        config = ("unreadable", exc.errno)
    else:
        config = (top.st_size, top.st_mtime_ns, top.st_ino) if top is not None and stat.S_ISREG(top.st_mode) else ()
    return VersionSignature(files, stamps, config, complete, truncated or more, writer)


def _stamps(top: Path, budget: list[int], *, recurse: bool) -> tuple[tuple, bool]:
    """(name, size, mtime_ns, inode) of each regular file in `top` (recurse: and in its
    subdirectories, named by their path under top, depth first), examining at most
    budget[0] entries (counted down); and whether entries were left unexamined. A
    directory gone or not one is empty; one that cannot be read, or an entry that cannot
    be stat'ed (a link to itself, a folder without search permission), is stamped
    unreadable with its errno: such an entry raised out of the poll, which then saw no
    change in any model, and out of the start. Links are followed, but a directory is
    walked once: a link back up the tree is not walked again and again."""
    stamps: list[tuple] = []
    walked: set[tuple[int, int]] = set()  # (device, inode) of the directories walked
    stack = [(top, "")]
    while stack:
        path, rel = stack.pop()
        try:
            walked.add(_identity(path.stat()))
            with os.scandir(path) as listing:
                # never more than the budget (and one to know there were more) from a huge directory
                entries = sorted(itertools.islice(listing, budget[0] + 1), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            stamps.append((rel or ".", "unreadable", exc.errno))
            continue
        subdirs = []
        for entry in entries:
            if budget[0] == 0:
                return tuple(stamps), True
            budget[0] -= 1
            try:
                st = Path(entry.path).stat()  # follows links: a link to a replaced file changes with it
            except (FileNotFoundError, NotADirectoryError):  # removed since the listing
                continue
            except OSError as exc:
                stamps.append((rel + entry.name, "unreadable", exc.errno))
                continue
            if stat.S_ISREG(st.st_mode):
                stamps.append((rel + entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
            elif recurse and stat.S_ISDIR(st.st_mode) and _identity(st) not in walked:
                walked.add(_identity(st))
                subdirs.append((Path(entry.path), f"{rel}{entry.name}/"))
        stack.extend(reversed(subdirs))
    return tuple(stamps), False


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _stat(path: Path) -> os.stat_result | None:
    """path's stat, or None when it is gone: a file removed between the listing and the
    stat (a version being replaced) raised out of a load (a 500) or the poll."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None


def signature(model: RepositoryModel, store: str | None = None) -> tuple:
    """What a change to a model on disk looks like: its config, the versions it has and
    the signatures of those its policy chooses (store: as version_signature's)."""
    return (model.error, tuple(model.available),
            tuple((v, version_signature(model, v, store)) for v in model.chosen))


def version_config(cfg, model: RepositoryModel, version: int):
    """The serve configuration of one model version: its directory, its name in requests,
    and its fanouts (config.fanouts_for: the --fanouts flag, else config.json's, else those
    it was saved with)."""
    from hybridgnn.models.checkpoint import read_config

    vdir = model.version_dir(version)
    fanouts = fanouts_for(read_config(vdir), flag=cfg.sampling.fanouts, repository=model.fanouts)
    # The update token guards the repository's load/unload API; a repository's versions
    # take no graph updates.
    return dataclasses.replace(cfg, model_dir=vdir, sampling=dataclasses.replace(cfg.sampling, fanouts=fanouts),
                               server=dataclasses.replace(cfg.server, model_name=model.name,
                                                          default_outputs=model.outputs),
                               updates=dataclasses.replace(cfg.updates, token=None))
