"""The model repository's layout and version policies, and the registry requests are
routed by (no server)."""

from __future__ import annotations

import json

import pytest

from hybridgnn.errors import ConfigError, NotFound
from hybridgnn.serving.repository.layout import VersionPolicy, scan_repository
from hybridgnn.serving.repository.models import Models


def _repo(tmp_path, layout: dict):
    for name, (versions, config) in layout.items():
        for v in versions:
            (tmp_path / name / str(v)).mkdir(parents=True)
        if config is not None:
            (tmp_path / name / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return tmp_path


def test_versions_and_policies(tmp_path):
    repo = _repo(tmp_path, {
        "a": ([1, 2, 10], None),  # default: the latest one
        "b": ([1, 2, 3], {"version_policy": {"latest": {"num_versions": 2}}, "fanouts": [5, 3]}),
        "c": ([1, 2, 3], {"version_policy": {"specific": {"versions": [1, 3, 7]}}}),
        "d": ([4, 5], {"version_policy": {"all": {}}}),
    })
    (repo / "a" / "notes").mkdir()  # not a version
    (repo / "a" / "0").mkdir()  # versions are positive
    (repo / "a" / "010").mkdir()  # and named as numbers are written (10 is there already)
    models = scan_repository(repo)
    assert {n: m.chosen for n, m in models.items()} == {"a": [10], "b": [2, 3], "c": [1, 3], "d": [4, 5]}
    assert models["b"].fanouts == (5, 3) and models["a"].fanouts is None
    assert models["a"].available == [1, 2, 10]


@pytest.mark.parametrize("config, match", [
    ("{not json", "not valid JSON"),
    ("[" * 100_000, "nested too deeply"),
    ({"fanouts": [2.9, True]}, "fanouts must be whole numbers"),
    ([1], "JSON object"),
    ({"version_policy": {"latest": {"num_versions": 0}}}, "num_versions"),
    ({"version_policy": {"specific": {"versions": ["1"]}}}, "positive integers"),
    ({"version_policy": {"newest": {}}}, "unknown version_policy"),
    ({"version_policy": {"latest": {}, "all": {}}}, "one of"),
    ({"fanouts": [0]}, "fanouts"),
    ({"outputs": ["logits", "secrets"]}, "outputs must be"),
])
def test_bad_configs_are_one_clear_line(tmp_path, config, match):
    with pytest.raises(ConfigError, match=match):
        scan_repository(_repo(tmp_path, {"m": ([1], config)}))


def test_an_empty_or_missing_repository_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no models"):
        scan_repository(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        scan_repository(tmp_path / "missing")


def test_requests_find_their_engine_or_a_404_naming_what_exists():
    models = Models()
    models.add("sage", "1", "sage-1")
    models.add("sage", "10", "sage-10")
    models.add("gcn", "2", "gcn-2")
    assert models.get("sage") == "sage-10" and models.get("sage", "1") == "sage-1"  # default: the highest
    assert models.names() == ["gcn", "sage"] and models.versions("sage") == ["1", "10"]
    assert [(n, v) for n, v, _ in models.items()] == [("gcn", "2"), ("sage", "1"), ("sage", "10")]
    with pytest.raises(NotFound, match=r"has no version '3'; versions: \['1', '10'\]"):
        models.get("sage", "3")
    with pytest.raises(NotFound, match=r"unknown model 'x'; this server serves \['gcn', 'sage'\]"):
        models.get("x")


def test_policy_defaults_to_the_latest_version():
    assert VersionPolicy().choose([1, 2, 3]) == [3]
    assert VersionPolicy(latest=None).choose([1, 2]) == [1, 2]


def test_a_repository_the_poll_cannot_read_is_one_warning_not_a_traceback_per_poll(tmp_path, monkeypatch, caplog):
    # A volume remounted or the repository directory swapped: every poll logged a traceback.
    import asyncio
    import logging
    import time
    from types import SimpleNamespace

    from hybridgnn.serving.repository import loader

    scans = []

    def counted(root, **kw):
        scans.append(root)
        return scan_repository(root, **kw)

    monkeypatch.setattr(loader, "scan_repository", counted)
    cfg = SimpleNamespace(model_repository=tmp_path / "gone", server=SimpleNamespace(repository_poll_s=0.001))
    repository = loader.Repository(cfg, None)

    async def polled(n: int) -> None:
        task = asyncio.create_task(repository._poll())
        deadline = time.monotonic() + 10
        while len(scans) < n:
            assert time.monotonic() < deadline, "the poll did not run"
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="hybridgnn.repository"):
        asyncio.run(polled(10))
        (tmp_path / "gone" / "sage").mkdir(parents=True)  # back, with a model of no versions yet
        asyncio.run(polled(12))
    assert not [r for r in caplog.records if r.exc_info]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "is not a directory; serving what is loaded" in warned[0]
    assert any("readable again" in r.getMessage() for r in caplog.records)


def test_a_model_removed_from_the_repository_stops_serving_and_the_last_one_stays(tmp_path, caplog):
    # It served on, listed "no version directory matches" entries for ever, and counted as
    # a model, so an unload could take every model still in the repository.
    import asyncio
    import logging
    import time
    from types import SimpleNamespace

    from hybridgnn.serving.repository import loader

    class Engine:
        stopped = False

        async def drain(self, timeout_s):
            pass

        async def stop(self):
            self.stopped = True

    root = _repo(tmp_path, {"kept": ([1], None), "gone": ([1], None)})
    cfg = SimpleNamespace(model_repository=root, server=SimpleNamespace(repository_poll_s=0.001, drain_timeout_s=1))
    repository = loader.Repository(cfg, None)
    on_disk = scan_repository(root, strict=False)
    engines = {name: Engine() for name in ("kept", "gone")}
    for name, engine in engines.items():
        repository.models.add(name, "1", engine)
        repository._seen[name] = loader.signature(on_disk[name])
    repository.models.unavailable[("gone", "2")] = "truncated model.pt"

    async def poll_until(done) -> None:
        task = asyncio.create_task(repository._poll())
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, "the poll did not act"
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*repository._retiring)

    import shutil

    shutil.rmtree(root / "gone")
    asyncio.run(poll_until(lambda: not repository.models.versions("gone")))
    assert engines["gone"].stopped and not engines["kept"].stopped
    assert repository.models.names() == ["kept"] and not repository.models.unavailable and "gone" not in repository._seen
    # the last model served stays (as an unload keeps it), said once
    (root / "other").mkdir()  # the repository is not empty: the scan reads it
    shutil.rmtree(root / "kept")
    with caplog.at_level(logging.INFO, logger="hybridgnn.repository"):
        asyncio.run(poll_until(lambda: "kept" not in repository._seen))
        later = time.monotonic() + 0.05  # some fifty polls more
        asyncio.run(poll_until(lambda: time.monotonic() > later))
    assert repository.models.names() == ["kept"] and not engines["kept"].stopped
    assert len([r for r in caplog.records if "last model served" in r.getMessage()]) == 1


def test_the_index_lists_each_version_once_a_failed_reload_as_the_reason_of_the_one_serving():
    from types import SimpleNamespace

    from hybridgnn.serving.v2.service import V2Service

    models = Models()
    models.add("sage", "1", SimpleNamespace(ready=True))
    models.add("sage", "2", SimpleNamespace(ready=True))
    models.unavailable[("sage", "2")] = "model.pt is truncated"  # its changed files: the old ones serve
    models.unavailable[("sage", "3")] = "golden outputs differ"
    index = V2Service.index(SimpleNamespace(models=models))
    assert [(e["version"], e["state"]) for e in index] == [("1", "READY"), ("2", "READY"), ("3", "UNAVAILABLE")]
    assert index[1]["reason"] == "serving the files loaded before; loading the changed ones failed: model.pt is truncated"


def test_a_file_removed_while_a_version_is_read_is_not_an_error(tmp_path, monkeypatch):
    # A version being replaced: a file listed, then gone before its stat, raised out of
    # load() (a 500 on the API) or the poll.
    from pathlib import Path

    from hybridgnn.serving.repository import layout

    root = _repo(tmp_path, {"sage": ([1], None)})
    (root / "sage" / "1" / "model.pt").write_bytes(b"w")
    (root / "sage" / "1" / "golden.pt").write_bytes(b"g")
    model = scan_repository(root, strict=False)["sage"]
    real_glob = Path.glob

    def listed_then_removed(self, pattern):
        found = list(real_glob(self, pattern))
        (root / "sage" / "1" / "golden.pt").unlink(missing_ok=True)
        return iter(found)

    monkeypatch.setattr(Path, "glob", listed_then_removed)
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # still there when checked, gone at the stat
    stamps, _ = layout.version_signature(model, 1)
    assert [name for name, _, _ in stamps] == ["model.pt"]
