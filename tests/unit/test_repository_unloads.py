"""An unload recorded in the repository (serving/repository/unloads.py), without a
server: the mark written under the repository's unload lock, or refused with nothing
written (the last model left to serve, a lock that cannot be opened or is held, a
shutdown that began meanwhile)."""

from __future__ import annotations

import pytest

from hybridgnn.capabilities import exclusive
from hybridgnn.errors import Conflict, Draining, ServiceUnavailable
from hybridgnn.serving.repository import unloads
from hybridgnn.serving.repository.layout import UNLOADED, mark_unloaded, scan_repository
from hybridgnn.serving.repository.unloads import UNLOAD_LOCK, record_unload


def _repo(tmp_path, *names: str):
    for name in names:
        (tmp_path / name / "1").mkdir(parents=True)
    return tmp_path


def _never() -> bool:
    return False


def test_an_unload_is_marked_in_the_models_directory_and_read_back_as_unloaded(tmp_path):
    root = _repo(tmp_path, "sage", "other")
    record_unload(root, "sage", _never)
    assert (root / "sage" / UNLOADED).is_file() and not (root / "other" / UNLOADED).exists()
    assert scan_repository(root, strict=False)["sage"].unloaded is True
    record_unload(root, "gone", _never)  # a model whose directory is gone needs no mark
    assert not (root / "gone").exists()


def test_the_last_model_left_to_serve_is_not_marked(tmp_path):
    root = _repo(tmp_path, "sage", "other")
    mark_unloaded(root / "other", "another replica")
    (root / "empty").mkdir()  # no version: nothing a restarted replica could serve
    with pytest.raises(Conflict, match="'sage' is the last model of the repository not unloaded with a version"):
        record_unload(root, "sage", _never)
    assert not (root / "sage" / UNLOADED).exists()


def test_a_shutdown_that_began_while_it_waited_records_nothing(tmp_path):
    root = _repo(tmp_path, "sage", "other")
    with pytest.raises(Draining, match="model 'sage' is not unloaded"):
        record_unload(root, "sage", lambda: True)
    assert not (root / "sage" / UNLOADED).exists()


def test_a_lock_that_cannot_be_opened_or_is_held_is_refused_in_one_line(tmp_path, monkeypatch):
    root = _repo(tmp_path, "sage", "other")
    (root / UNLOAD_LOCK).mkdir()
    with pytest.raises(Conflict, match=r"the repository's unload lock .*\.unload\.lock cannot be opened"):
        record_unload(root, "sage", _never)
    (root / UNLOAD_LOCK).rmdir()
    monkeypatch.setattr(unloads, "UNLOAD_LOCK_WAIT_S", 0.2)
    with exclusive(root / UNLOAD_LOCK, "a test holding it"):  # another open file: as another replica holds it
        with pytest.raises(ServiceUnavailable, match=r"another process holds the repository's unload lock"):
            record_unload(root, "sage", _never)
    assert not (root / "sage" / UNLOADED).exists()
