"""Where the offline commands write (--out): a path that cannot take the output is refused in
one line, exit 2, before the command's work, not after it."""

import os
from pathlib import Path

import pytest

from hybridgnn.cli.main import main


class WorkStarted(Exception):
    pass


@pytest.fixture(autouse=True)
def _no_work(monkeypatch):
    """Each command's long work raises WorkStarted: a refusal must come before it."""
    import hybridgnn.cli.model
    import hybridgnn.demo
    import hybridgnn.graph.generate
    import hybridgnn.graph.hetero_generate
    import hybridgnn.models.train
    import hybridgnn.profiling.profile
    import hybridgnn.workload.tables

    def work(*_args, **_kwargs):
        raise WorkStarted

    for module, name in ((hybridgnn.demo, "ensure_demo"), (hybridgnn.models.train, "train"),
                         (hybridgnn.cli.model, "_factory"),
                         (hybridgnn.profiling.profile, "build_profile"), (hybridgnn.graph.generate, "generate_csbm"),
                         (hybridgnn.graph.generate, "generate_powerlaw"),
                         (hybridgnn.graph.hetero_generate, "generate_hetero"),
                         (hybridgnn.workload.tables.WorkloadTables, "load_or_build")):
        monkeypatch.setattr(module, name, work)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from hybridgnn.graph.generate import generate_csbm

    path = tmp_path_factory.mktemp("outputs") / "g"
    generate_csbm(path, num_nodes=60, num_classes=2, feature_dim=4, avg_degree=4, seed=0)
    return path


def _commands(dataset: Path, out: Path) -> dict[str, list[str]]:
    return {
        "train": ["train", "--dataset", str(dataset), "--out", str(out)],
        "export": ["model", "export", "--factory", "m:build", "--weights", "w.pt", "--out", str(out)],
        "profile": ["profile", "--out", str(out)],
        "generate": ["dataset", "generate", "csbm", "--out", str(out)],
        "hetero": ["dataset", "generate", "hetero", "--out", str(out)],
        "place": ["place", "--dataset", str(dataset), "--out", str(out)],
    }


def _refused(argv, capsys) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("command", ["train", "export", "profile", "generate", "hetero", "place"])
def test_out_under_a_file_is_refused_before_the_work(command, dataset, tmp_path, capsys):
    taken = tmp_path / "a_file"
    taken.write_text("mine\n")
    for out in (taken / "out", taken / "sub" / "out"):
        err = _refused(_commands(dataset, out)[command], capsys)
        assert f"error: cannot use {taken}: Not a directory" in err, err
    assert taken.read_text() == "mine\n"


@pytest.mark.parametrize("command", ["train", "export", "generate", "hetero", "place"])
def test_a_file_where_the_output_directory_goes_is_refused_before_the_work(command, dataset, tmp_path, capsys):
    taken = tmp_path / "a_file"
    taken.write_text("mine\n")
    err = _refused(_commands(dataset, taken)[command], capsys)
    assert f"error: cannot use {taken}: Not a directory" in err, err
    assert taken.read_text() == "mine\n"


def test_a_directory_where_the_profile_or_a_plot_goes_is_refused_before_profiling(tmp_path, capsys):
    (tmp_path / "p.json").mkdir()
    err = _refused(["profile", "--out", str(tmp_path / "p.json")], capsys)
    assert f"hybridgnn profile: error: cannot use {tmp_path / 'p.json'}: Is a directory" in err
    (tmp_path / "q.svg").mkdir()
    err = _refused(["profile", "--out", str(tmp_path / "q.json")], capsys)
    assert f"cannot use {tmp_path / 'q.svg'}: Is a directory" in err
    with pytest.raises(WorkStarted):  # without plots the .svg is not written: nothing to refuse
        main(["profile", "--out", str(tmp_path / "q.json"), "--no-plot"])


def test_the_default_profile_folder_is_checked_before_profiling(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("profiles").write_text("")
    err = _refused(["profile"], capsys)
    assert "hybridgnn profile: error: cannot use profiles: Not a directory" in err


@pytest.mark.parametrize("command", ["train", "export", "profile", "generate", "place"])
def test_a_folder_that_cannot_be_written_is_refused_before_the_work(command, dataset, tmp_path, capsys, monkeypatch):
    """chmod does not stop root (who runs these tests in CI): the check asks os.access, so
    a folder it says no to stands in for a read-only one."""
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and access(p, mode, **kw))
    for out in (locked / "out", locked / "new" / "out"):
        err = _refused(_commands(dataset, out)[command], capsys)
        assert f"error: cannot use {locked}: Permission denied" in err, err


def test_every_check_passes_a_path_that_can_be_written(dataset, tmp_path, capsys):
    for argv in _commands(dataset, tmp_path / "new" / "out").values():
        with pytest.raises(WorkStarted):
            main(argv)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WorkStarted):
        main(_commands(dataset, tmp_path / "empty")["generate"])


def test_workload_build_checks_its_folder_beside_the_dataset(dataset, tmp_path, capsys, monkeypatch):
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != dataset and access(p, mode, **kw))
    import hybridgnn.workload.tables

    def work(*_args, **_kwargs):
        raise WorkStarted

    monkeypatch.setattr(hybridgnn.workload.tables.WorkloadTables, "build", work)
    err = _refused(["workload", "build", "--dataset", str(dataset), "--fanouts", "2"], capsys)
    assert f"cannot use {dataset}: Permission denied" in err, err


# --- outputs made beside their place and moved in whole --------------------------------

def _csbm(out: Path, *extra: str) -> list[str]:
    return ["dataset", "generate", "csbm", "--out", str(out), "--num-nodes", "60", "--num-classes", "2",
            "--feature-dim", "4", "--avg-degree", "4", *extra]


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def real_generators(monkeypatch):
    monkeypatch.undo()  # this module's stand-ins for the long work, taken back


def test_generate_replaces_an_existing_dataset_only_with_force_and_then_whole(real_generators, tmp_path, capsys):
    import json

    out = tmp_path / "g"
    assert main(_csbm(out)) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "g"  # not the hidden sibling's name
    before = _tree(out)
    err = _refused(_csbm(out, "--seed", "1"), capsys)
    assert f"hybridgnn dataset: error: {out} already exists; pass --force to replace it" in err
    assert _tree(out) == before
    (out / "workload").mkdir()  # tables of the old graph go with it
    assert main(_csbm(out, "--seed", "1", "--force")) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "g" and info["path"] == str(out.resolve())
    assert not (out / "workload").exists() and _tree(out)["indices.npy"] != before["indices.npy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # nothing left beside it


def test_an_interrupted_generate_leaves_the_old_dataset_whole(real_generators, tmp_path, capsys, monkeypatch):
    """It wrote over --out in place: Ctrl-C (or a kill) midway left half a new dataset where
    a good one was."""
    import hybridgnn.graph.generate

    out = tmp_path / "g"
    assert main(_csbm(out)) == 0
    before = _tree(out)
    written = []

    def interrupted(root, **_kwargs):
        (Path(root) / "indptr.npy").write_bytes(b"half")
        written.append(Path(root))
        raise KeyboardInterrupt

    monkeypatch.setattr(hybridgnn.graph.generate, "write_dataset", interrupted)
    assert main(_csbm(out, "--seed", "1", "--force")) == 130
    assert written and written[0] != out and written[0].parent == out.parent
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]


@pytest.fixture
def plan_dataset(tmp_path) -> Path:
    from hybridgnn.graph.generate import generate_csbm

    path = tmp_path / "g"
    generate_csbm(path, num_nodes=60, num_classes=2, feature_dim=4, avg_degree=4, seed=0)
    return path


def _place(dataset: Path, out: Path, *extra: str) -> list[str]:
    return ["place", "--dataset", str(dataset), "--fanouts", "2,2", "--topology", str(TOPOLOGY), "--out", str(out),
            *extra]


TOPOLOGY = Path(__file__).resolve().parents[2] / "deploy" / "topology.example.json"


def test_place_replaces_a_plan_whole_and_never_other_files(real_generators, plan_dataset, tmp_path, capsys,
                                                           monkeypatch):
    import json

    from hybridgnn.features.placement import Plan

    out = tmp_path / "plan"
    assert main(_place(plan_dataset, out)) == 0
    assert Plan.load(out).method == "fap"
    (out / "disk-server0-0123456789ab.npy").write_bytes(b"")  # a server's disk-tier copy beside it
    assert main(_place(plan_dataset, out, "--method", "hash")) == 0
    assert Plan.load(out).method == "hash" and not (out / "disk-server0-0123456789ab.npy").exists()
    before = _tree(out)

    def interrupted(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "plan.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(Plan, "save", interrupted)
    capsys.readouterr()
    assert main(_place(plan_dataset, out, "--method", "degree")) == 130
    assert _tree(out) == before and Plan.load(out).method == "hash"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g", "plan"]
    assert capsys.readouterr().err == "hybridgnn place: interrupted\n"

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep\n")
    (mine / "plan.json").write_text(json.dumps({}))
    err = _refused(_place(plan_dataset, mine), capsys)
    assert f"hybridgnn place: error: {mine} holds files other than a placement plan" in err
    assert (mine / "notes.txt").read_text() == "keep\n"
    err = _refused(_place(plan_dataset, plan_dataset), capsys)  # the dataset itself: never removed
    assert "holds files other than a placement plan" in err and (plan_dataset / "meta.json").is_file()


def test_a_failed_move_puts_the_old_output_back(tmp_path, monkeypatch):
    from hybridgnn.cli.outputs import staged_directory

    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old\n")
    rename = Path.rename

    def failing(self, target):
        if Path(target) == out and self.name.startswith(".out.test-"):
            raise OSError(28, "No space left on device", str(target))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="No space"), staged_directory(out, "test") as staging:
        staging.mkdir()
        (staging / "new").write_text("new\n")
    assert _tree(out) == {"old": b"old\n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_what_killed_runs_left_beside_an_output_is_removed_by_the_next(tmp_path):
    """A run killed with -9 leaves its hidden staging (or the replaced old output) beside
    --out; the next run removes those of processes that are gone, never a live one's."""
    import os

    from hybridgnn.cli.outputs import staged_directory

    out = tmp_path / "out"
    gone = 4_194_305  # past Linux's largest pid: no such process
    for name in (f".out.generating-{gone}", f".out.replaced-{gone}", f".out.generating-{os.getppid()}",
                 f".other.generating-{gone}"):
        (tmp_path / name).mkdir()
    with staged_directory(out, "generating") as staging:
        staging.mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", f".out.generating-{os.getppid()}", f".other.generating-{gone}"])


def test_only_what_staged_runs_leave_is_removed_beside_an_output(tmp_path):
    """Any hidden sibling .<name>.<word>-<digits> whose number was no live pid went: a
    user's own .out.bak-20240101 (past any pid) was removed by the next generate."""
    from hybridgnn.cli.outputs import staged_directory

    out = tmp_path / "out"
    gone = 4_194_305  # past Linux's largest pid: no such process
    mine = [".out.bak-20240101", f".out.old-{gone}", f".out.x.generating-{gone}"]
    for name in (*mine, f".out.importing-{gone}", f".out.placing-{gone}"):
        (tmp_path / name).mkdir()
    with staged_directory(out, "generating") as staging:
        staging.mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *mine])


@pytest.mark.parametrize("command", ["generate", "place"])
def test_a_link_at_out_is_followed_and_stays(command, real_generators, plan_dataset, tmp_path, capsys):
    """place renamed the link aside and put a directory in its place: the plan landed beside
    the link (another disk perhaps), the link was gone, its target left as it was."""
    target = tmp_path / "elsewhere" / "out"
    target.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target)
    argv = _csbm(link, "--force") if command == "generate" else _place(plan_dataset, link)
    for _ in range(2):  # made, then replaced
        assert main(argv) == 0
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert (target / ("meta.json" if command == "generate" else "plan.json")).is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]


@pytest.mark.parametrize("command", ["generate", "place", "train", "export"])
def test_out_through_a_link_checks_the_folder_it_is_made_in(command, dataset, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    (locked / "out").mkdir(parents=True)
    (tmp_path / "link").symlink_to(locked / "out")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and access(p, mode, **kw))
    argv = _commands(dataset, tmp_path / "link")[command]
    err = _refused(argv, capsys)
    assert f"error: cannot use {locked}: Permission denied" in err, err


@pytest.mark.parametrize("command", ["generate", "place", "train", "export"])
def test_out_that_is_or_holds_the_working_directory_is_refused(command, dataset, tmp_path, capsys, monkeypatch):
    """--out . was replaced whole: generate then read `.` (the removed directory it still
    stood in) and failed after writing; place failed on renaming `.`."""
    work = tmp_path / "work"
    work.mkdir()  # empty: place took it for a new plan's place, generate (no --force needed) too
    for cwd, out in ((work, "."), (work, str(work)), (work / "sub", ".."), (work / "sub", str(work))):
        cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        err = _refused(_commands(dataset, Path(out))[command] + (["--force"] if command == "generate" else []),
                       capsys)
        assert f"--out {out} is the directory this command runs in, or holds it" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and (work / "sub").is_dir()


@pytest.mark.parametrize("command", ["generate", "place", "train", "export"])
def test_a_mount_point_at_out_is_refused_before_the_work(command, dataset, tmp_path, capsys, monkeypatch):
    """A volume mounted at --out cannot be renamed: the whole output was made beside it (on
    the filesystem above), then the move failed with "Device or resource busy". A bind
    mount within one filesystem is seen in /proc/self/mountinfo (os.path.ismount misses it)."""
    from hybridgnn.cli import outputs

    volume = tmp_path / "my volume"
    volume.mkdir()
    mountinfo = tmp_path / "mountinfo"
    escaped = str(volume).replace(" ", "\\040")
    mountinfo.write_text(f"36 35 98:0 / / rw - ext4 /dev/root rw\n37 36 98:0 /src {escaped} rw - ext4 /dev/root rw\n")
    monkeypatch.setattr(outputs, "MOUNTINFO", str(mountinfo))
    err = _refused(_commands(dataset, volume)[command], capsys)
    assert f"--out {volume} is a mount point" in err and f"such as {volume}/<name>" in err, err
    monkeypatch.setattr(outputs, "MOUNTINFO", str(tmp_path / "none"))
    ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == volume or ismount(p))
    assert "is a mount point" in _refused(_commands(dataset, volume)[command], capsys)
    with pytest.raises(WorkStarted):  # a directory inside it is made and moved as any other
        main(_commands(dataset, volume / "out")[command])


# --- model directories: train and model export ------------------------------------------

FACTORY = """
from torch_geometric.nn.models import GraphSAGE


def build():
    return GraphSAGE(4, 8, 2, 2)
"""


def _model_commands(dataset: Path, out: Path, tmp_path: Path, monkeypatch) -> dict[str, list[str]]:
    """train and model export of small models into `out` (export's factory and weights made
    in tmp_path, the working directory)."""
    import sys

    import torch

    (tmp_path / "small_factory_mod.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "small_factory_mod", raising=False)
    import small_factory_mod

    torch.save(small_factory_mod.build().state_dict(), tmp_path / "w.pt")
    return {"train": ["train", "--dataset", str(dataset), "--out", str(out), "--epochs", "1", "--hidden-dim", "4",
                      "--fanouts", "2,2"],
            "export": ["model", "export", "--factory", "small_factory_mod:build", "--weights", "w.pt",
                       "--out", str(out), "--fanouts", "2,2"]}


@pytest.mark.parametrize("command", ["train", "export"])
def test_a_model_directory_is_replaced_only_with_force_and_then_whole(command, real_generators, plan_dataset,
                                                                      tmp_path, capsys, monkeypatch):
    """train and model export wrote over an existing --out file by file, without --force:
    another model's weights (and its precomputed embeddings, kept beside them) were lost
    to a command run twice on one path."""
    import json

    out = tmp_path / "m"
    argv = _model_commands(plan_dataset, out, tmp_path, monkeypatch)[command]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(out)
    (out / "embeddings").mkdir()  # what precompute kept beside the weights
    before = _tree(out)
    name = "model" if command == "export" else "train"
    err = _refused(argv, capsys)
    assert f"hybridgnn {name}: error: {out} already exists; pass --force to replace it" in err, err
    assert _tree(out) == before and (out / "embeddings").is_dir()
    assert main([*argv, "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(out)
    assert not (out / "embeddings").exists() and {"config.json", "model.pt", "golden.pt"} <= set(_tree(out))
    assert main(["model", "check", str(out)]) == 0
    leftover = {p.name for p in tmp_path.iterdir()} - {"g", "m", "w.pt", "small_factory_mod.py", "__pycache__"}
    assert leftover == set()  # nothing left beside it


@pytest.mark.parametrize("command", ["train", "export"])
def test_an_interrupted_model_write_leaves_the_old_model_whole(command, real_generators, plan_dataset, tmp_path,
                                                               capsys, monkeypatch):
    import hybridgnn.models.checkpoint

    out = tmp_path / "m"
    argv = _model_commands(plan_dataset, out, tmp_path, monkeypatch)[command]
    assert main(argv) == 0
    before = _tree(out)
    written = []

    def interrupted(path, *_a, **_kw):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.pt").write_bytes(b"half")
        written.append(Path(path))
        raise KeyboardInterrupt

    monkeypatch.setattr(hybridgnn.models.checkpoint, "write_replacing", lambda p, _w: interrupted(Path(p).parent))
    assert main([*argv, "--force"]) == 130
    assert written and written[0] != out and written[0].parent == out.parent
    assert _tree(out) == before
    assert not any(p.name.startswith(".m.") for p in tmp_path.iterdir())
