"""CLI commands that talk to a server, pointed at one that is not there."""

from hybridgnn.cli.main import main
from tests.support.server import free_port


def test_bench_against_a_server_that_is_down_is_one_line_and_exit_2(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--url", url, "--duration-s", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hybridgnn bench: error: cannot load {url}") and err.count("\n") == 1


def test_help_and_flag_errors_load_neither_torch_nor_numpy():
    """`--help` and argument errors answer from argparse alone: the heavy imports come
    after parsing (they cost seconds on a cold start)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom hybridgnn.cli.main import main\n"
             "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
             "try:\n    main(['serve', '--max-wait-ms'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'numpy', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:] + out.stderr[-500:]
    assert "usage: hybridgnn serve" in out.stdout and "expected one argument" in out.stderr


def test_serving_without_the_token_a_dataset_whose_log_holds_updates_is_one_line_and_exit_2(
        tiny_dataset, tiny_model, tmp_path, capsys, monkeypatch):
    import shutil

    from hybridgnn.updates.log import SqliteLog

    monkeypatch.delenv("HYBRIDGNN_UPDATE_TOKEN", raising=False)
    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset)
    log = SqliteLog(dataset / "updates.sqlite", "any")
    log.append(b"an acknowledged update")
    log.close()
    assert main(["serve", "--dataset", str(dataset), "--model", str(tiny_model), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "holds acknowledged graph updates (up to position 1)" in err and "--update-log off" in err and err.count("\n") == 1


def test_a_port_in_use_is_refused_before_anything_slow(capsys, monkeypatch):
    """It was said only after the worker processes had started (and, on a first run, after
    the demo was generated: the test fails if it is)."""
    import socket

    import hybridgnn.demo

    def no_demo(*_args, **_kwargs):
        raise AssertionError("the demo was generated before the port was checked")

    monkeypatch.setattr(hybridgnn.demo, "ensure_demo", no_demo)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv in (["serve", "--port", str(port)], ["serve", "--port", "0", "--grpc-port", str(port)]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err == f"hybridgnn serve: error: port {port} on 127.0.0.1 is in use (another server still running?)\n"


def test_bench_naming_a_model_the_server_does_not_serve_says_what_the_server_said(capsys):
    """It was "ClientResponseError: 404, message='Not Found', url=...": the server's own
    answer, which lists the models it serves, was not shown."""
    import asyncio
    import threading

    from aiohttp import web

    async def metadata(request: web.Request) -> web.Response:
        return web.json_response({"error": "unknown model 'foo'; this server serves ['hybridgnn']"}, status=404)

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/v2/models/{m}", metadata)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        assert main(["bench", "--url", url, "--model", "foo", "--duration-s", "1"]) == 2
        err = capsys.readouterr().err
        assert err == (f"hybridgnn bench: error: cannot load {url} model 'foo': the server answered 404: unknown "
                       "model 'foo'; this server serves ['hybridgnn']\n"), err
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
