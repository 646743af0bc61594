"""Unloads recorded in the repository itself, so that they reach every replica serving it
and survive restarts: an unload through the API writes its model's mark
(layout.mark_unloaded) under the repository's unload lock, unless no other model with a
version to serve would be left unmarked; what cannot be recorded is refused, and then
nothing is unloaded (loader.Repository.unload).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from hybridgnn.capabilities import exclusive
from hybridgnn.errors import ConfigError, Conflict, Draining, ServiceUnavailable
from hybridgnn.serving.repository.layout import UNLOADED, mark_unloaded, scan_repository

log = logging.getLogger("hybridgnn.repository")
# In the repository's directory: held while an unload checks the marks and writes its own,
# so two replicas unloading the last two unmarked models at once cannot both succeed.
UNLOAD_LOCK = ".unload.lock"
# How long an unload waits for that lock (held for a scan and a small write, normally a few
# milliseconds): a holder stopped (SIGSTOP, a paused container) or an operator's `flock`
# held every unload of this server, and with it every load, poll and its shutdown, for as long.
UNLOAD_LOCK_WAIT_S = 10.0


def record_unload(root: Path, name: str, closing: Callable[[], bool]) -> None:
    """(In a worker thread, holding the server's load lock.) Record model `name`'s unload
    in its directory of repository `root`, unless every other model of the repository is
    marked already (another replica's unloads: none would be left to serve, and no
    replica could start). Conflict, and nothing written, when it cannot be recorded;
    Draining when `closing()` says the server began shutting down while it waited for the
    lock. A model whose directory is gone needs no mark: its removal reaches every
    replica."""
    try:
        with exclusive(root / UNLOAD_LOCK, "waiting for another replica's unload of a repository model",
                       timeout_s=UNLOAD_LOCK_WAIT_S):
            if closing():  # shutdown began while it waited: its request is answered 503, so nothing is done
                raise Draining(f"the server is shutting down; model {name!r} is not unloaded")
            on_disk = scan_repository(root, strict=False)
            model = on_disk.get(name)
            if model is None:
                return
            # only models with a version to serve count: an empty directory or a broken
            # config.json left the repository with nothing a restarted replica could serve
            if not [n for n, m in on_disk.items() if n != name and m.unloaded is False and m.chosen]:
                raise Conflict(f"model {name!r} is the last model of the repository not unloaded with a "
                               "version to serve (the others are marked unloaded, through another replica's "
                               "API perhaps, or have none); load another first")
            mark = mark_unloaded(model.root, f"POST /v2/repository/models/{name}/unload")
    except ConfigError as exc:  # the repository is unreadable now
        raise Conflict(f"model {name!r} is not unloaded: {exc}") from exc
    except TimeoutError as exc:
        raise ServiceUnavailable(f"model {name!r} is not unloaded: another process holds the repository's unload "
                                 f"lock {root / UNLOAD_LOCK} (a replica unloading, stopped meanwhile?) for more "
                                 f"than {UNLOAD_LOCK_WAIT_S:g}s; try again") from exc
    except OSError as exc:
        if exc.filename is not None and Path(exc.filename) == root / UNLOAD_LOCK:  # what no lock opens is there
            raise Conflict(f"model {name!r} is not unloaded: the repository's unload lock {root / UNLOAD_LOCK} "
                           f"cannot be opened ({exc.strerror or exc}); remove what is at that path") from exc
        raise Conflict(
            f"model {name!r} is not unloaded: an unload must be recorded in the repository (the file "
            f"{root / name / UNLOADED}) to survive restarts and reach every replica serving it, and it cannot be "
            f"written there ({exc.strerror or exc}); on a repository this server may not write, delete the "
            "model's directory where it can be written: every replica's poll then unloads the model") from exc
    log.info("model %s: unload recorded in %s", name, mark)
