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
    import hybridgnn.demo
    import hybridgnn.graph.generate
    import hybridgnn.graph.hetero_generate
    import hybridgnn.models.train
    import hybridgnn.profiling.profile
    import hybridgnn.workload.tables

    def work(*_args, **_kwargs):
        raise WorkStarted

    for module, name in ((hybridgnn.demo, "ensure_demo"), (hybridgnn.models.train, "train"),
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


@pytest.mark.parametrize("command", ["train", "profile", "generate", "hetero", "place"])
def test_out_under_a_file_is_refused_before_the_work(command, dataset, tmp_path, capsys):
    taken = tmp_path / "a_file"
    taken.write_text("mine\n")
    for out in (taken / "out", taken / "sub" / "out"):
        err = _refused(_commands(dataset, out)[command], capsys)
        assert f"error: cannot use {taken}: Not a directory" in err, err
    assert taken.read_text() == "mine\n"


@pytest.mark.parametrize("command", ["train", "generate", "hetero", "place"])
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


@pytest.mark.parametrize("command", ["train", "profile", "generate", "place"])
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
