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
    forgotten = []  # the metrics series of versions unloaded are dropped, once each is stopped
    repository = loader.Repository(cfg, SimpleNamespace(forget_model=lambda *version: forgotten.append(version)))
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
    assert engines["gone"].stopped and not engines["kept"].stopped and forgotten == [("gone", "1")]
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
    import contextlib
    import os

    from hybridgnn.serving.repository import layout

    root = _repo(tmp_path, {"sage": ([1], None)})
    (root / "sage" / "1" / "model.pt").write_bytes(b"w")
    (root / "sage" / "1" / "golden.pt").write_bytes(b"g")
    model = scan_repository(root, strict=False)["sage"]
    real_scandir = os.scandir

    @contextlib.contextmanager
    def listed_then_removed(path):
        with real_scandir(path) as listing:
            entries = list(listing)
        (root / "sage" / "1" / "golden.pt").unlink(missing_ok=True)
        yield iter(entries)

    monkeypatch.setattr(layout.os, "scandir", listed_then_removed)
    signed = layout.version_signature(model, 1)
    assert [name for name, *_ in signed.files] == ["model.pt"]


def _store(vdir, *, complete: bool = True, fingerprint: str = "fp", layers: int = 1):
    """An embedding store as a precompute writes it (files replaced by a rename)."""
    import os

    store = vdir / "embeddings" / fingerprint
    store.mkdir(parents=True, exist_ok=True)
    for i in range(layers):
        (store / "tmp").write_bytes(os.urandom(64))
        (store / "tmp").replace(store / f"layer_{i + 1}.npy")
    (store / "state.json").write_text(json.dumps({"complete": complete}))
    return store


def test_a_store_file_replaced_by_a_rename_changes_the_version_signature(tmp_path):
    # The signature looked only at the version directory's own files: new embeddings moved
    # into embeddings/<dataset>/ never reloaded the version.
    import os

    from hybridgnn.serving.repository.layout import version_signature

    root = _repo(tmp_path, {"sage": ([1], None)})
    vdir = root / "sage" / "1"
    (vdir / "model.pt").write_bytes(b"w")
    store = _store(vdir)
    _store(vdir, fingerprint="other")  # another dataset's store: not read by this server's loads
    (vdir / "notes").mkdir()  # nor is any other directory
    model = scan_repository(root)["sage"]
    before = version_signature(model, 1, "fp")
    assert [name for name, *_ in before.store] == ["layer_1.npy", "state.json"] and before.store_complete
    old = (store / "layer_1.npy").stat()
    (store / "new").write_bytes(os.urandom(64))  # same size; same mtime too: only the inode tells
    os.utime(store / "new", ns=(old.st_atime_ns, old.st_mtime_ns))
    (store / "new").replace(store / "layer_1.npy")
    assert version_signature(model, 1, "fp") != before
    before = version_signature(model, 1, "fp")
    _store(root / "sage" / "1", fingerprint="other")
    (vdir / "notes" / "x").write_text("x")
    assert version_signature(model, 1, "fp") == before
    # with no dataset named, every store counts, nested ones too (a heterogeneous store's types/<i>/)
    nested = store / "types" / "0"
    nested.mkdir(parents=True)
    everything = version_signature(model, 1)
    (nested / "layer_1.npy").write_bytes(b"x")
    assert version_signature(model, 1) != everything
    assert [name for name, *_ in version_signature(model, 1).store] == [
        "fp/layer_1.npy", "fp/state.json", "fp/types/0/layer_1.npy", "other/layer_1.npy", "other/state.json"]


def test_the_signature_walk_is_bounded(tmp_path, monkeypatch):
    from hybridgnn.serving.repository import layout

    root = _repo(tmp_path, {"sage": ([1], None)})
    vdir = root / "sage" / "1"
    (vdir / "model.pt").write_bytes(b"w")
    _store(vdir, layers=20)
    model = scan_repository(root)["sage"]
    assert not layout.version_signature(model, 1, "fp").truncated
    monkeypatch.setattr(layout, "SIGNATURE_ENTRIES", 8)
    signed = layout.version_signature(model, 1, "fp")
    # model.pt and embeddings/ at the top; 6 of the store's 21 files (the first 7 listed, in
    # name order): then it stops and says so
    assert signed.truncated and len(signed.files) == 1 and len(signed.store) == 6
    unseen = sorted({p.name for p in (vdir / "embeddings" / "fp").iterdir()} - {name for name, *_ in signed.store})
    (vdir / "embeddings" / "fp" / unseen[0]).write_bytes(b"x")  # past the cap: not seen
    assert layout.version_signature(model, 1, "fp") == signed


def test_links_that_loop_in_a_version_are_stamped_not_raised(tmp_path, monkeypatch):
    # A link to itself in a store (or anywhere a signature stamps) raised ELOOP out of the
    # stat: out of the start (no model served) and of every poll (no change in any model
    # seen). A link back up the tree was walked again and again until the cap.
    import asyncio
    import os

    from hybridgnn.serving.repository import layout

    repository, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    store = root / "sage" / "1" / "embeddings" / "fp"
    os.symlink("loop", store / "loop")
    os.symlink("..", store / "up")
    os.symlink("self.json", root / "sage" / "1" / "self.json")
    model = scan_repository(root)["sage"]
    signed = layout.version_signature(model, 1, "fp")
    assert not signed.truncated and signed.store_complete
    assert ("loop", "unreadable", 40) in signed.store and ("self.json", "unreadable", 40) in signed.files
    assert [s[0] for s in signed.store] == ["layer_1.npy", "loop", "state.json"]  # up/fp/ is fp/: walked once
    asyncio.run(repository.start())
    assert sorted(opened) == [("other", "1"), ("sage", "1")]
    _store(root / "other" / "1")  # a change elsewhere is still seen
    _polls(repository, 10)
    assert sorted(opened) == [("other", "1"), ("other", "1"), ("sage", "1")]


def _fake_loads(tmp_path, monkeypatch, versions: dict):
    """A Repository over `versions` ({model: write its store at start?}) whose engine starts
    and precomputes are stand-ins: opened lists each (model, version) started, precomputed
    each precompute run; a precompute writes the store (as the child does) and fails for a
    model named "broken" after writing part of it."""
    from types import SimpleNamespace

    from hybridgnn.serving.repository import loader

    root = tmp_path / "repo"
    for name, stored in versions.items():
        vdir = root / name / "1"
        vdir.mkdir(parents=True)
        (vdir / "model.pt").write_bytes(b"w")
        if stored:
            _store(vdir)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "meta.json").write_text(json.dumps({"fingerprint": "fp"}))
    opened, precomputed = [], []

    class Engine:
        async def drain(self, timeout_s):
            pass

        async def stop(self):
            pass

    async def open_engine(cfg, stats, *, version, share_with):
        opened.append((cfg.name, version))
        return Engine()

    async def precompute(self, cfg):
        state = cfg.model_dir / "embeddings" / "fp" / "state.json"
        if state.is_file() and json.loads(state.read_text())["complete"]:
            return False
        precomputed.append(cfg.name)
        if cfg.name == "broken":
            _store(cfg.model_dir, complete=False)
            raise ConfigError("precomputing failed (exit 1)")
        _store(cfg.model_dir)
        return True

    monkeypatch.setattr(loader, "open_engine", open_engine)
    monkeypatch.setattr(loader, "version_config", lambda cfg, model, version: SimpleNamespace(
        name=model.name, model_dir=model.version_dir(version)))
    monkeypatch.setattr(loader.Repository, "_precompute", precompute)
    cfg = SimpleNamespace(model_repository=root, dataset_dir=dataset,
                          server=SimpleNamespace(repository_poll_s=0, drain_timeout_s=1))
    return loader.Repository(cfg, None), root, opened, precomputed


def _polls(repository, n: int) -> None:
    """Let the repository's poll run n times (every millisecond)."""
    import asyncio
    import time

    from hybridgnn.serving.repository import loader

    async def run() -> None:
        scans = []
        real = loader.scan_repository

        def counted(*args, **kw):
            scans.append(1)
            return real(*args, **kw)

        loader.scan_repository = counted
        repository.cfg.server.repository_poll_s = 0.001
        task = asyncio.create_task(repository._poll())
        try:
            deadline = time.monotonic() + 10
            while len(scans) < n:
                assert time.monotonic() < deadline, "the poll did not run"
                await asyncio.sleep(0.001)
        finally:
            loader.scan_repository = real
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(*repository._retiring)

    asyncio.run(run())


def test_a_store_replaced_on_disk_reloads_the_version_once(tmp_path, monkeypatch):
    import asyncio

    repository, root, opened, precomputed = _fake_loads(tmp_path, monkeypatch, {"sage": True})
    asyncio.run(repository.start())
    assert opened == [("sage", "1")] and not precomputed
    _polls(repository, 10)
    assert opened == [("sage", "1")]
    _store(root / "sage" / "1")  # new embeddings moved in
    _polls(repository, 10)
    assert opened == [("sage", "1")] * 2 and not precomputed


def test_the_servers_own_precompute_is_no_change_for_the_poll(tmp_path, monkeypatch):
    # Once the signature covered the store, the embeddings a load precomputed were a change
    # the next poll loaded again; after a failed precompute (part of a store written) every
    # poll loaded, precomputed and failed again, for ever.
    import asyncio

    repository, root, opened, precomputed = _fake_loads(tmp_path, monkeypatch,
                                                        {"sage": False, "broken": False})
    asyncio.run(repository.start())
    assert sorted(opened) == [("sage", "1")] and sorted(precomputed) == ["broken", "sage"]
    assert "precomputing failed" in repository.models.unavailable[("broken", "1")]
    _polls(repository, 20)
    assert sorted(opened) == [("sage", "1")] and sorted(precomputed) == ["broken", "sage"]
    # a change to what it read is still one: model.pt replaced
    (root / "broken" / "1" / "tmp").write_bytes(b"new weights")
    (root / "broken" / "1" / "tmp").replace(root / "broken" / "1" / "model.pt")
    _polls(repository, 10)
    assert sorted(precomputed) == ["broken", "broken", "sage"]


def test_a_store_being_written_is_loaded_once_complete(tmp_path, monkeypatch, caplog):
    # `hybridgnn precompute` run on a served version: a poll that loaded it while the store
    # was written found no complete store and started a second precompute on the same files.
    import asyncio
    import logging

    repository, root, opened, precomputed = _fake_loads(tmp_path, monkeypatch, {"sage": True})
    asyncio.run(repository.start())
    vdir = root / "sage" / "1"
    with caplog.at_level(logging.INFO, logger="hybridgnn.repository"):
        for _ in range(3):  # a layer at a time, a poll or more between
            _store(vdir, complete=False)
            _polls(repository, 4)
    assert opened == [("sage", "1")] and not precomputed
    assert len([r for r in caplog.records if "being written" in r.getMessage()]) == 1
    _store(vdir)  # done
    _polls(repository, 10)
    assert opened == [("sage", "1")] * 2 and not precomputed


def test_a_store_another_process_holds_is_left_to_it_and_loaded_once_its_writer_is_gone(tmp_path, monkeypatch):
    # `hybridgnn precompute` run on a new version: the poll loaded it, and the load's own
    # precompute waited for that one, holding every load and poll meanwhile (for ever if
    # it was stopped with Ctrl-Z). One killed mid-way left its part-store unloaded.
    import asyncio

    from hybridgnn.capabilities import exclusive
    from hybridgnn.embeddings.store import store_lock

    repository, root, opened, precomputed = _fake_loads(tmp_path, monkeypatch, {"sage": True})
    asyncio.run(repository.start())
    v2 = root / "sage" / "2"
    v2.mkdir()
    (v2 / "model.pt").write_bytes(b"new weights")
    with exclusive(store_lock(v2 / "embeddings" / "fp"), "the test's writer"):
        _polls(repository, 6)
        assert opened == [("sage", "1")] and not precomputed
        _store(v2, complete=False)  # a layer written, then the writer stopped
        _polls(repository, 6)
        assert opened == [("sage", "1")] and not precomputed
        # a load through the API says so instead of waiting with it
        assert asyncio.run(repository.load("sage")) == ["1"] and not precomputed
        assert "being written by another process" in repository.models.unavailable[("sage", "2")]
    # killed: its lock went with it, and the poll loads the version (its precompute resumes)
    _polls(repository, 6)
    assert opened == [("sage", "1"), ("sage", "2")] and precomputed == ["sage"]


def test_the_poll_reads_the_disk_off_the_event_loop_and_a_load_waits_for_its_read(tmp_path, monkeypatch):
    # The scan, the stats of every file and the config reads ran on the event loop: on a
    # slow or network filesystem every request stalled for as long as a poll read.
    import asyncio
    import threading
    import time

    from hybridgnn.serving.repository import loader

    repository, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True})
    asyncio.run(repository.start())
    (root / "sage" / "2").mkdir()  # a new version: the poll loads it
    (root / "sage" / "2" / "model.pt").write_bytes(b"w")
    threads: dict[str, set[int]] = {"scan": set(), "signature": set(), "config": set()}
    reads = {"begun": 0, "now": 0, "most": 0, "done": 0}
    real_scan, real_signature, real_config = loader.scan_repository, loader.signature, loader.version_config

    def slow_scan(*args, **kw):
        threads["scan"].add(threading.get_ident())
        reads["begun"] += 1
        reads["now"] += 1
        reads["most"] = max(reads["most"], reads["now"])
        try:
            time.sleep(0.6)  # a slow filesystem: a loop blocked by a read stalls this long
            return real_scan(*args, **kw)
        finally:
            reads["now"] -= 1
            reads["done"] += 1

    def signature(*args):
        threads["signature"].add(threading.get_ident())
        return real_signature(*args)

    def version_config(*args):
        threads["config"].add(threading.get_ident())
        return real_config(*args)

    monkeypatch.setattr(loader, "scan_repository", slow_scan)
    monkeypatch.setattr(loader, "signature", signature)
    monkeypatch.setattr(loader, "version_config", version_config)

    async def run() -> tuple[int, float]:
        loop_thread = threading.get_ident()
        repository.cfg.server.repository_poll_s = 0.001
        poll = asyncio.create_task(repository._poll())
        deadline = time.monotonic() + 10
        while not reads["begun"]:  # the poll is reading
            assert time.monotonic() < deadline, "the poll did not read"
            await asyncio.sleep(0.001)
        # the API's load, meanwhile: it reads after the poll's read, and what it applies is
        # what it read (version 2 started once, by whichever of the two reaches it first)
        load = asyncio.create_task(repository.load("sage"))
        longest, last = 0.0, time.perf_counter()
        while not load.done() or reads["done"] < 4:
            assert time.monotonic() < deadline, "the load did not finish"
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        poll.cancel()
        await asyncio.gather(poll, return_exceptions=True)
        assert await load == ["2"]  # the latest version (the default policy)
        return loop_thread, longest

    loop_thread, longest = asyncio.run(run())
    assert all(threads.values()) and not any(loop_thread in t for t in threads.values()), threads
    assert longest < 0.4, f"the event loop stalled {longest:.3f}s while the repository was read"
    assert reads["most"] == 1  # one read at a time: the poll's and the load's never overlap
    assert opened == [("sage", "1"), ("sage", "2")]


def test_a_graph_update_to_a_repository_says_updates_serve_one_model_not_to_set_the_token_it_has():
    from types import SimpleNamespace

    from hybridgnn.errors import Forbidden
    from hybridgnn.serving.repository.loader import Repository
    from hybridgnn.serving.v2.service import V2Service
    from hybridgnn.types import ServingStats

    repository = Repository(SimpleNamespace(updates=SimpleNamespace(token="a-token-1")), stats=None)
    repository.models.add("sage", "1", SimpleNamespace(cfg=SimpleNamespace(updates=SimpleNamespace(token=None)),
                                                       stats=ServingStats()))
    with pytest.raises(Forbidden, match="not a model repository") as refused:
        V2Service(repository).authorize_update("sage", None, "Bearer a-token-1")
    assert "start it with --update-token" not in str(refused.value)


@pytest.mark.parametrize("authorization, ok", [
    ("Bearer a-token-1", True), ("bearer a-token-1", True), ("BEARER a-token-1", True), ("Bearer   a-token-1", True),
    ("Bearer a-token-1x", False), ("Bearer a-token-", False), ("Basic a-token-1", False), ("Bearera-token-1", False),
    ("a-token-1", False), ("Bearer", False), ("", False), ("Bearer a-token-1, Bearer a-token-1", False),
    ("Bearer \udcff", False)])
def test_the_bearer_scheme_is_case_insensitive_and_the_token_exact(authorization, ok):
    """RFC 9110 11.1: the scheme is a case-insensitive token, and one or more spaces may follow
    it; 'bearer <token>' was a 401."""
    from types import SimpleNamespace

    from hybridgnn.errors import Unauthorized
    from hybridgnn.serving.repository.loader import Repository
    from hybridgnn.serving.v2.service import V2Service
    from hybridgnn.types import ServingStats

    repository = Repository(SimpleNamespace(updates=SimpleNamespace(token=None)), stats=None)
    repository.models.add("sage", "1", SimpleNamespace(cfg=SimpleNamespace(updates=SimpleNamespace(token="a-token-1")),
                                                       stats=ServingStats()))
    service = V2Service(repository)
    if ok:
        assert service.authorize_update("sage", None, authorization) is not None
    else:
        with pytest.raises(Unauthorized, match="'Authorization: Bearer <token>'"):
            service.authorize_update("sage", None, authorization)


def test_a_load_that_chooses_no_version_says_why_without_an_empty_version():
    # The 409 said "version : no version directory matches the version policy".
    import asyncio
    from types import SimpleNamespace

    from hybridgnn.errors import Conflict
    from hybridgnn.serving.v2.service import V2Service

    models = Models()
    models.unavailable[("pol", "")] = "no version directory matches the version policy (on disk: [1])"

    async def load(name):
        return []

    repository = SimpleNamespace(load=load, models=models)
    service = SimpleNamespace(_repository=lambda authorization: repository)
    with pytest.raises(Conflict) as info:
        asyncio.run(V2Service.load(service, "pol", "Bearer x"))
    assert str(info.value) == ("model 'pol' could not be loaded: no version directory matches the version policy "
                               "(on disk: [1])")


def test_a_model_unloaded_through_the_api_is_listed_unloaded_until_loaded_again(tmp_path, monkeypatch):
    # The index listed nothing of it, so a client could not see what it could load again.
    import asyncio
    from types import SimpleNamespace

    from hybridgnn.serving.v2.service import V2Service

    repository, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})

    def index():
        for _, _, engine in repository.models.items():
            engine.ready = True
        return V2Service.index(SimpleNamespace(models=repository.models))

    asyncio.run(repository.start())
    asyncio.run(repository.unload("sage"))
    _polls(repository, 3)  # the poll leaves it unloaded
    assert index() == [{"name": "other", "version": "1", "state": "READY", "reason": ""},
                       {"name": "sage", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
    assert asyncio.run(repository.load("sage")) == ["1"]
    assert [(e["name"], e["state"]) for e in index()] == [("other", "READY"), ("sage", "READY")]


def test_what_is_kept_of_versions_is_bounded_by_those_serving(tmp_path, monkeypatch):
    # Each retired version's file stamps were kept for ever: a server that saw a new
    # version every hour grew by one signature (up to 4,096 stamps) an hour.
    import asyncio
    import shutil

    repository, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    asyncio.run(repository.start())
    for version in range(2, 12):
        shutil.copytree(root / "sage" / str(version - 1), root / "sage" / f".new-{version}")
        (root / "sage" / f".new-{version}").rename(root / "sage" / str(version))
        assert asyncio.run(repository.load("sage")) == [str(version)]
    assert sorted(repository._started) == [("other", "1"), ("sage", "11")]
    asyncio.run(repository.unload("sage"))
    assert sorted(repository._started) == [("other", "1")]


def test_a_model_directory_named_in_bytes_not_utf8_is_listed_readable_and_never_served(tmp_path):
    # It was listed under a surrogate-escaped name no URL or gRPC string can carry.
    import os

    _repo(tmp_path, {"good": ([1], None)})
    os.makedirs(os.path.join(os.fsencode(tmp_path), b"bad\xff", b"1"))
    models = scan_repository(tmp_path, strict=False)
    assert sorted(models) == ["bad\ufffd", "good"]
    bad = models["bad\ufffd"]
    assert "is not UTF-8, so no request can name the model: rename it" in bad.error and bad.chosen == []
    json.dumps(sorted(models), ensure_ascii=False).encode("utf-8")  # what the index answers can be encoded
    with pytest.raises(ConfigError, match="is not UTF-8"):
        scan_repository(tmp_path)


def test_a_huge_repository_config_is_listed_with_why_not_read(tmp_path):
    # The poll read it whole every time it looked at the repository.
    import resource

    def _peak_rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    (tmp_path / "m" / "1").mkdir(parents=True)
    with open(tmp_path / "m" / "config.json", "wb") as f:
        f.truncate(1 << 30)
    before = _peak_rss_mb()
    model = scan_repository(tmp_path, strict=False)["m"]
    assert "more than such a file holds" in model.error and _peak_rss_mb() - before < 256


def test_an_inference_naming_no_served_version_is_counted_under_one_served_never_one_unloaded():
    # After a repository's first model version was unloaded, every 404 for an unknown model
    # or version (and every unparsable body for one) was counted under that version: its
    # series, dropped at the unload, came back for good under a version no longer served.
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from hybridgnn.serving.v2.service import V2Service
    from hybridgnn.telemetry.metrics import Telemetry

    telemetry = Telemetry(model="alpha")

    def engine(name: str, version: str):
        return SimpleNamespace(stats=telemetry.for_model(name, version), model_stats=SimpleNamespace(failed=lambda s: None),
                               ready=True)

    models = Models()
    for name, version in (("alpha", "1"), ("beta", "1"), ("beta", "2")):
        models.add(name, version, engine(name, version))
    service = V2Service(models)
    models.remove("alpha", "1")  # a new version replaces it, as a repository's reload does
    telemetry.forget_model("alpha", "1")
    models.add("alpha", "2", engine("alpha", "2"))

    service.count_unparsed("nosuch", None, 404)  # no such model: the first one served
    service.count_unparsed("beta", "7", 404)  # no such version: the model's highest
    service.count_unparsed("alpha", "1", 404)  # the version unloaded: the model's new one
    text = telemetry.exposition()[0].decode()
    counted = {(s.labels["model"], s.labels["version"]): s.value
               for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "hybridgnn_requests_total" and s.value}
    assert counted == {("beta", "1"): 1.0, ("beta", "2"): 1.0, ("alpha", "2"): 1.0}
    assert 'version="1",model="alpha"' not in text and 'model="alpha",version="1"' not in text


def test_the_unload_mark_is_read_by_the_scan_and_no_change_of_the_models_files(tmp_path):
    from hybridgnn.serving.repository.layout import (
        UNLOADED,
        clear_unloaded,
        mark_unloaded,
        signature,
    )

    root = _repo(tmp_path, {"sage": ([1], {"outputs": ["logits"]}), "bad": ([1], "{not json")})
    before = scan_repository(root, strict=False)
    assert not before["sage"].unloaded and not before["bad"].unloaded
    signed = signature(before["sage"], "fp")
    for name in ("sage", "bad"):  # a model whose config cannot be used is marked all the same
        mark_unloaded(root / name, "a test")
    after = scan_repository(root, strict=False)
    assert after["sage"].unloaded and after["bad"].unloaded and after["bad"].error
    assert signature(after["sage"], "fp") == signed and after["sage"].chosen == [1]  # no version, no change
    mark = json.loads((root / "sage" / UNLOADED).read_text())
    assert mark["through"] == "a test" and mark["unloaded_unix_s"] > 0
    assert sorted(p.name for p in (root / "sage").iterdir()) == [UNLOADED, "1", "config.json"]  # no temporary left
    clear_unloaded(root / "sage")
    clear_unloaded(root / "sage")  # not there: nothing to do
    assert not scan_repository(root, strict=False)["sage"].unloaded


def test_an_unload_is_recorded_in_the_repository_and_survives_a_restart_until_a_load(tmp_path, monkeypatch):
    # The unload lived in the process's memory: restarted (or killed), the server served
    # the model again.
    import asyncio

    from hybridgnn.serving.repository import loader
    from hybridgnn.serving.repository.layout import UNLOADED

    repository, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    asyncio.run(repository.start())
    asyncio.run(repository.unload("sage"))
    assert (root / "sage" / UNLOADED).is_file() and repository.models.names() == ["other"]

    restarted = loader.Repository(repository.cfg, None)
    opened.clear()
    asyncio.run(restarted.start())
    assert opened == [("other", "1")] and restarted.models.names() == ["other"]
    assert restarted.models.unavailable == {("sage", "1"): "unloaded"}
    _polls(restarted, 3)  # the poll leaves it unloaded
    assert restarted.models.names() == ["other"]

    assert asyncio.run(restarted.load("sage")) == ["1"]  # a load removes the mark
    assert not (root / "sage" / UNLOADED).exists() and not restarted.models.unavailable
    again = loader.Repository(repository.cfg, None)
    asyncio.run(again.start())
    assert again.models.names() == ["other", "sage"]


def test_an_unload_or_a_load_through_one_replica_reaches_the_others_at_their_poll(tmp_path, monkeypatch, caplog):
    import asyncio
    import logging

    from hybridgnn.serving.repository import loader

    a, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    b = loader.Repository(a.cfg, None)
    asyncio.run(a.start())
    asyncio.run(b.start())
    asyncio.run(a.unload("sage"))
    _polls(b, 3)
    assert b.models.names() == ["other"] and b.models.unavailable == {("sage", "1"): "unloaded"}
    asyncio.run(b.load("sage"))  # b serves both again; a is told at its poll
    _polls(a, 3)
    assert a.models.names() == b.models.names() == ["other", "sage"] and not a.models.unavailable
    asyncio.run(a.unload("other"))
    with caplog.at_level(logging.INFO, logger="hybridgnn.repository"):
        _polls(b, 3)
    assert b.models.names() == ["sage"] and b.models.unavailable == {("other", "1"): "unloaded"}
    assert any("marked unloaded" in r.getMessage() for r in caplog.records)


def test_the_last_model_marked_by_another_replica_serves_on_with_one_warning(tmp_path, monkeypatch, caplog):
    import asyncio
    import logging

    from hybridgnn.serving.repository import loader
    from hybridgnn.serving.repository.layout import mark_unloaded

    a, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    asyncio.run(a.start())
    asyncio.run(a.unload("other"))
    mark_unloaded(root / "sage", "an operator")  # every model marked: this replica keeps its last
    with caplog.at_level(logging.INFO, logger="hybridgnn.repository"):
        _polls(a, 10)
    assert a.models.names() == ["sage"]
    assert len([r for r in caplog.records if "last model served" in r.getMessage()]) == 1
    with pytest.raises(ConfigError, match=r"every model of repository .* is marked unloaded.*"
                                          r"delete the mark of each model to serve: \[.*other/\.unloaded.*sage/\.unloaded"):
        asyncio.run(loader.Repository(a.cfg, None).start())
    (root / "other" / ".unloaded").unlink()  # deleted by hand: loaded at the next poll, and then sage goes
    _polls(a, 5)
    assert a.models.names() == ["other"] and a.models.unavailable == {("sage", "1"): "unloaded"}


def test_an_unload_that_would_leave_every_model_marked_is_refused(tmp_path, monkeypatch):
    import asyncio

    from hybridgnn.errors import Conflict
    from hybridgnn.serving.repository import loader

    a, root, _, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    b = loader.Repository(a.cfg, None)
    asyncio.run(a.start())
    asyncio.run(b.start())
    asyncio.run(a.unload("sage"))
    with pytest.raises(Conflict, match="last model of the repository not unloaded"):
        asyncio.run(b.unload("other"))  # b serves both still, but no replica could start after it
    assert b.models.names() == ["other", "sage"] and not (root / "other" / ".unloaded").exists()
    # a model directory with no version, or a broken config.json, is no model to serve either
    (root / "empty").mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    with pytest.raises(Conflict, match="last model of the repository not unloaded with a version to serve"):
        asyncio.run(b.unload("other"))
    assert not (root / "other" / ".unloaded").exists()


def test_an_unload_or_load_that_cannot_be_recorded_changes_nothing(tmp_path, monkeypatch):
    # An unload must be recorded in the repository to survive restarts and reach every replica.
    import asyncio

    from hybridgnn.errors import Conflict
    from hybridgnn.serving.repository import layout, loader, unloads

    repository, root, _, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    asyncio.run(repository.start())

    def refused(path, write):
        raise PermissionError(13, "Permission denied", str(path))

    with monkeypatch.context() as m:
        m.setattr(layout, "write_replacing", refused)
        with pytest.raises(Conflict, match=r"model 'sage' is not unloaded: an unload must be recorded in the "
                                           r"repository .*survive restarts and reach every replica.*Permission "
                                           r"denied.*delete the model's directory"):
            asyncio.run(repository.unload("sage"))
    assert repository.models.names() == ["other", "sage"] and not repository.models.unavailable
    assert sorted(p.name for p in (root / "sage").iterdir()) == ["1"]

    (root / unloads.UNLOAD_LOCK).unlink()
    (root / unloads.UNLOAD_LOCK).mkdir()  # what no lock opens: the answer names the lock, not the mark
    with pytest.raises(Conflict, match=r"model 'sage' is not unloaded: the repository's unload lock .*\.unload\.lock "
                                       r"cannot be opened \(Is a directory\); remove what is at that path"):
        asyncio.run(repository.unload("sage"))
    assert repository.models.names() == ["other", "sage"] and not repository.models.unavailable
    (root / unloads.UNLOAD_LOCK).rmdir()

    layout.mark_unloaded(root / "sage", "another replica")
    _polls(repository, 3)
    assert repository.models.names() == ["other"]

    def unremovable(model_root):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(loader, "clear_unloaded", unremovable)
    with pytest.raises(Conflict, match=r"model 'sage' is not loaded: .* must remove the mark .*sage/\.unloaded.*"
                                       r"Read-only file system"):
        asyncio.run(repository.load("sage"))
    assert repository.models.names() == ["other"] and repository.models.unavailable == {("sage", "1"): "unloaded"}
    _polls(repository, 3)
    assert repository.models.names() == ["other"]


def test_a_model_that_cannot_be_read_at_start_spoils_no_other(tmp_path, monkeypatch):
    # Its load's Conflict (a config.json that cannot be used) escaped the start: the server
    # refused to start over one bad model, where a poll or a load lists it with why.
    import asyncio

    repository, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    (root / "other" / "config.json").write_text("{not json")
    asyncio.run(repository.start())
    assert opened == [("sage", "1")] and repository.models.names() == ["sage"]
    assert list(repository.models.unavailable) == [("other", "")]
    assert "not valid JSON" in repository.models.unavailable[("other", "")]


def test_a_model_whose_directory_cannot_be_read_for_a_while_is_left_as_it_is(tmp_path, monkeypatch):
    # A mark that could not be looked at counted as there: a poll while a served model's
    # directory was unreadable (a chmod, a remount) unloaded it, unasked.
    import asyncio
    import os

    from hybridgnn.serving.repository import layout

    repository, root, opened, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True, "third": True})
    asyncio.run(repository.start())
    asyncio.run(repository.unload("third"))
    real_lstat, real_read = os.lstat, layout._read_model
    shut = {root / "other", root / "third"}

    def lstat(path, *args, **kw):
        if layout.Path(path).parent in shut:
            raise PermissionError(13, "Permission denied", str(path))
        return real_lstat(path, *args, **kw)

    def read_model(path):
        if path in shut:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    with monkeypatch.context() as m:
        m.setattr(os, "lstat", lstat)
        m.setattr(layout, "_read_model", read_model)
        assert layout.is_marked_unloaded(root / "other") is None
        _polls(repository, 3)
        assert repository.models.names() == ["other", "sage"]  # other serves on; third stays unloaded
        assert "Permission denied" in repository.models.unavailable[("other", "")]
    _polls(repository, 3)
    assert repository.models.names() == ["other", "sage"]
    assert repository.models.unavailable == {("third", "1"): "unloaded"}
    assert (root / "third" / layout.UNLOADED).exists() and not (root / "other" / layout.UNLOADED).exists()


def test_a_repository_that_cannot_be_listed_is_a_config_error_not_an_os_error(tmp_path, monkeypatch):
    # PermissionError out of the scan: a load through the API while the repository was
    # unreadable answered 500 with a traceback in the log (the service answers a
    # ConfigError with 409).
    import asyncio
    from pathlib import Path

    repository, root, _, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    asyncio.run(repository.start())
    real = Path.iterdir

    def iterdir(self):
        if self == root:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(ConfigError, match=r"model repository .* cannot be read: Permission denied"):
        scan_repository(root, strict=False)
    for name in ("sage", "nosuch"):
        with pytest.raises(ConfigError, match="cannot be read"):
            asyncio.run(repository.load(name))
    assert repository.models.names() == ["other", "sage"]


def _hold(lock_path, release_after_s: float):
    """Hold an flock on lock_path (as another replica would) until release_after_s passes,
    or the returned function is called."""
    import fcntl
    import os
    import threading

    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            os.close(fd)

    timer = threading.Timer(release_after_s, release)
    timer.start()
    return release


def test_an_unload_waits_for_a_held_unload_lock_a_bounded_time(tmp_path, monkeypatch):
    # Another process holding REPO/.unload.lock (a replica stopped while it held it, a
    # frozen container, an operator's flock) held the unload for as long: with it every
    # load and poll of this server, and its shutdown.
    import asyncio
    import time

    from hybridgnn.errors import ServiceUnavailable
    from hybridgnn.serving.repository import loader, unloads

    repository, root, _, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    asyncio.run(repository.start())
    monkeypatch.setattr(unloads, "UNLOAD_LOCK_WAIT_S", 0.3)
    release = _hold(root / unloads.UNLOAD_LOCK, release_after_s=5)
    try:
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable, match=r"another process holds the repository's unload lock"):
            asyncio.run(repository.unload("sage"))
        assert time.monotonic() - t0 < 3
    finally:
        release()
    assert repository.models.names() == ["other", "sage"] and not (root / "sage" / loader.UNLOADED).exists()
    asyncio.run(repository.unload("sage"))  # the lock free: done
    assert repository.models.names() == ["other"]


def test_an_unload_that_waited_for_the_lock_past_the_start_of_shutdown_records_nothing(tmp_path, monkeypatch):
    # Its request was answered 503 (retry) at shutdown, but the unload was recorded once the
    # lock came free: a retry elsewhere found it unloaded already.
    import asyncio

    from hybridgnn.errors import Draining
    from hybridgnn.serving.repository import loader, unloads

    repository, root, _, _ = _fake_loads(tmp_path, monkeypatch, {"sage": True, "other": True})
    asyncio.run(repository.start())
    release = _hold(root / unloads.UNLOAD_LOCK, release_after_s=5)

    async def run() -> None:
        unload = asyncio.create_task(repository.unload("sage"))
        await asyncio.sleep(0.2)
        repository.begin_shutdown()
        release()
        with pytest.raises(Draining):
            await unload

    try:
        asyncio.run(run())
    finally:
        release()
    assert not (root / "sage" / loader.UNLOADED).exists() and repository.models.names() == ["other", "sage"]



def test_a_stopped_versions_embedding_files_are_let_go_at_once_not_at_the_next_full_collection(tiny_dataset,
                                                                                                 tiny_model_pe):
    # An engine and its parts refer to one another, so a retired version lived on until the
    # interpreter's next full collection, and with it its store's memory maps: an open file
    # each (a removed version's disk space too) and its pages. A server taking a new version
    # every 20 s held 38 retired stores' files after 9 minutes, and 300 MB more RSS.
    import gc
    import os

    from hybridgnn.config import ServeConfig
    from hybridgnn.runtime.resources import Resources

    store = str(tiny_model_pe / "embeddings") + "/"

    def files_open() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(store)
            except OSError:  # closed meanwhile (the listing's own descriptor)
                pass
        return n

    gc.collect()
    gc.disable()  # what a stopped engine's cycles do: the Resources stays referenced
    try:
        before = files_open()
        r = Resources.open(ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe))
        assert r.embeddings is not None and r.new_nodes is not None
        assert files_open() > before
        r.close()
        assert files_open() == before
    finally:
        gc.enable()
