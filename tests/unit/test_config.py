import dataclasses

import pytest

from hybridgnn.config import (
    BatcherConfig,
    PipelineConfig,
    PolicyConfig,
    RouterConfig,
    SamplingConfig,
    ServerConfig,
    env_default,
    env_flag,
    parse_cpus,
    parse_fanouts,
)


def test_parse_fanouts():
    assert parse_fanouts("15,10,5") == (15, 10, 5)
    assert parse_fanouts([3, 2]) == (3, 2)
    with pytest.raises(ValueError, match="positive"):
        parse_fanouts("3,0")
    with pytest.raises(ValueError, match="comma-separated"):
        parse_fanouts("a,b")
    with pytest.raises(ValueError, match="at least one hop"):
        parse_fanouts("")


def test_parse_cpus():
    assert parse_cpus("1") == (1,)
    assert parse_cpus("3,0-1") == (0, 1, 3)
    assert parse_cpus(" 2 - 4 , 2") == (2, 3, 4)
    assert parse_cpus("") == () and parse_cpus([2, 1, 2]) == (1, 2)
    for bad in ("a", "1-", "3-1", "-2", "1.5", "0-100000000", "4096"):
        with pytest.raises(ValueError, match="cores must be"):
            parse_cpus(bad)


def test_worker_cores_pin_processes_only():
    assert PipelineConfig(processes=True, cpus=(1, 3)).cpus == (1, 3)
    with pytest.raises(ValueError, match="need --worker-processes"):
        PipelineConfig(cpus=(1,))
    with pytest.raises(ValueError, match="distinct core numbers"):
        PipelineConfig(processes=True, cpus=(1, 1))
    with pytest.raises(ValueError, match="distinct core numbers"):
        PipelineConfig(processes=True, cpus=(-1,))


@pytest.mark.parametrize("make, match", [
    (lambda: SamplingConfig(fanouts=(5, -1)), "positive"),
    (lambda: BatcherConfig(max_batch_seeds=0), "max_batch_seeds"),
    (lambda: BatcherConfig(max_wait_s=-1), "max_wait_s"),
    (lambda: BatcherConfig(max_pending_requests=0), "max_pending_requests"),
    (lambda: PipelineConfig(workers=0), "workers"),
    (lambda: RouterConfig(psgs_threshold=-1), "psgs_threshold"),
    (lambda: ServerConfig(port=70000), "port"),
    (lambda: ServerConfig(model_name="a/b"), "model_name"),
    (lambda: ServerConfig(repository_poll_s=-1), "repository_poll_s must be 0 .no polling. or at least"),  # was 0
    (lambda: ServerConfig(repository_poll_s=1e-9), "repository_poll_s must be 0 .no polling. or at least"),  # spun
    (lambda: ServerConfig(repository_poll_s=float("nan")), "repository_poll_s must be a number"),
    (lambda: ServerConfig(seed_log_interval_s=0), "seed_log_interval_s must be a finite number of seconds > 0"),
    (lambda: ServerConfig(seed_log_interval_s=float("inf")), "seed_log_interval_s must be a finite number"),
    (lambda: PolicyConfig(policy="fastest"), "slo:<ms> or slo-mean:<ms>, got 'fastest'"),  # slo-mean was unnamed
])
def test_bad_values_are_quoted(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_defaults_are_valid_and_frozen():
    cfg = RouterConfig()
    assert cfg.psgs_threshold is None  # +inf without a GPU pipeline; with one, the PSGS of 64 average seeds
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.psgs_threshold = 3  # frozen


def test_env_default(monkeypatch):
    monkeypatch.setenv("HYBRIDGNN_PORT", "9123")
    assert env_default("PORT", 8000, int) == 9123
    monkeypatch.setenv("HYBRIDGNN_PORT", "x")
    with pytest.raises(ValueError, match="HYBRIDGNN_PORT"):
        env_default("PORT", 8000, int)
    assert env_default("NOT_SET_ANYWHERE", 5, int) == 5
    for raw, want in (("false", False), ("0", False), ("Off", False), ("true", True), ("1", True), ("YES", True)):
        monkeypatch.setenv("HYBRIDGNN_SPILL", raw)
        assert env_default("SPILL", None, env_flag) is want
    monkeypatch.setenv("HYBRIDGNN_SPILL", "maybe")
    with pytest.raises(ValueError, match="HYBRIDGNN_SPILL='maybe' is not a valid boolean"):
        env_default("SPILL", True, env_flag)


def test_the_demo_cache_follows_xdg_cache_home_when_it_is_an_absolute_path(monkeypatch, tmp_path):
    """XDG_CACHE_HOME= (set but empty) put the demo cache in ./hybridgnn, under the working
    directory; the XDG spec says an empty or relative value is to be ignored."""
    from pathlib import Path

    from hybridgnn.config import default_cache_dir

    monkeypatch.delenv("HYBRIDGNN_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hybridgnn"
    for unusable in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", unusable)
        assert default_cache_dir() == tmp_path / "home" / ".cache" / "hybridgnn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "hybridgnn"
    monkeypatch.setenv("HYBRIDGNN_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_fanouts_come_from_one_precedence():
    """flag, then the repository's config.json, then the saved fanouts, then 10 per layer."""
    from hybridgnn.config import DEFAULT_FANOUT, fanouts_for

    saved = {"num_layers": 3, "fanouts": [7, 6, 5]}
    assert fanouts_for(saved, flag="4,3,2", repository=(9, 9, 9)) == (4, 3, 2)
    assert fanouts_for(saved, repository=(9, 9, 9)) == (9, 9, 9)
    assert fanouts_for(saved) == (7, 6, 5)
    assert fanouts_for({"num_layers": 3}) == (DEFAULT_FANOUT,) * 3
    with pytest.raises(ValueError, match="positive"):
        fanouts_for(saved, flag="4,0")


def test_a_repository_version_takes_the_flag_over_its_config_json(tmp_path):
    """The same precedence in a model repository as for --model: a --fanouts flag binds
    every version; without it config.json's, else the version's own."""
    import json

    from hybridgnn.config import SamplingConfig, ServeConfig
    from hybridgnn.serving.repository.layout import scan_repository, version_config

    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "config.json").write_text(json.dumps(
        {"class": "hybridgnn.GNN", "args": {}, "num_layers": 2, "in_dim": 4, "out_dim": 2, "fanouts": [5, 5]}))
    model = scan_repository(tmp_path)["m"]
    base = ServeConfig(dataset_dir=tmp_path, model_dir=tmp_path / "m" / "1")
    assert version_config(base, model, 1).sampling.fanouts == (5, 5)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"fanouts": [8, 4]}))
    model = scan_repository(tmp_path)["m"]
    assert version_config(base, model, 1).sampling.fanouts == (8, 4)
    flagged = dataclasses.replace(base, sampling=SamplingConfig(fanouts=(3, 2)))
    assert version_config(flagged, model, 1).sampling.fanouts == (3, 2)


def test_nan_is_refused_for_every_setting_that_is_a_number():
    """NaN passes every `x <= 0` check; each config class refuses it by name instead."""
    import hybridgnn.config as config

    classes = [c for c in vars(config).values() if isinstance(c, type) and c.__module__.startswith(config.__name__)
               and dataclasses.is_dataclass(c) and c is not config.ServeConfig]
    checked = 0
    for cls in classes:
        for f in dataclasses.fields(cls):
            default = cls.__dataclass_fields__[f.name].default
            if isinstance(default, float):
                with pytest.raises(ValueError, match=f"{f.name} must be a number, got NaN"):
                    cls(**{f.name: float("nan")})
                checked += 1
    assert checked >= 15


def test_read_json_says_why_a_file_is_not_json(tmp_path):
    from hybridgnn.config import read_json

    path = tmp_path / "c.json"
    for text, why in (("[" * 100_000, "nested too deeply"), ("{", "Expecting"), (b"\xff\xfe{", "codec")):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=f"not valid JSON: .*{why}"):
            read_json(path)
    path.write_text('{"a": [1]}')
    assert read_json(path) == {"a": [1]}


def test_fanouts_past_a_one_layer_model_are_cut_with_a_warning_in_words(caplog):
    """It said "the model has 1 layers"."""
    from hybridgnn.config import fanouts_served

    with caplog.at_level("WARNING", logger="hybridgnn.serve"):
        assert fanouts_served([10, 5], 1) == (10,)
    assert "fanouts [10, 5] give 2 hops but the model has 1 layer; sampling the first 1" in caplog.text


def test_a_repositorys_update_token_guards_loads_and_turns_no_graph_updates_on(tmp_path):
    """A model repository's --update-token guards loading and unloading versions, which serve
    a static graph: worker processes, the GPU pipeline and the split lane stay allowed (they
    were refused as if the graph took updates)."""
    from hybridgnn.config import ServeConfig, UpdateConfig

    gpu = PipelineConfig(name="gpu", device="cuda")
    repo = ServeConfig(None, None, model_repository=tmp_path, updates=UpdateConfig(token="token-123"), gpu_pipeline=gpu,
                       cpu_pipeline=PipelineConfig(name="cpu", processes=True))
    assert repo.updates.enabled and not repo.graph_updates
    ServeConfig(None, None, model_repository=tmp_path, updates=UpdateConfig(token="token-123"), gpu_pipeline=gpu,
                cpu_pipeline=PipelineConfig(name="cpu", split=True))
    one = ServeConfig(None, None, updates=UpdateConfig(token="token-123"))
    assert one.graph_updates
    with pytest.raises(ValueError, match="worker processes serve a static graph"):
        ServeConfig(None, None, updates=UpdateConfig(token="token-123"), cpu_pipeline=PipelineConfig(name="cpu", processes=True))
    with pytest.raises(ValueError, match="graph updates run on the CPU pipeline only"):
        ServeConfig(None, None, updates=UpdateConfig(token="token-123"), gpu_pipeline=gpu)


@pytest.mark.parametrize("token, ok", [("token-123", True), ("a token with inner blanks", True),
                                       ("~!#$%&'*+-.^_`|0=/", True), ("token-123\n", False),
                                       (" token-123", False), ("token-123 ", False), ("tökén-123", False),
                                       ("token\t123", False), ("token\x00123", False)])
def test_an_update_token_must_be_one_an_authorization_header_carries_as_it_is(token, ok):
    """A token with a trailing newline (a secret file read into the variable), blanks around it,
    control or non-ASCII characters started a server that refused every update 401."""
    from hybridgnn.config import UpdateConfig

    if ok:
        assert UpdateConfig(token=token).enabled
    else:
        with pytest.raises(ValueError, match="the update token must be printable ASCII"):
            UpdateConfig(token=token)
