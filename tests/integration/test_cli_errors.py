"""CLI commands that talk to a server, pointed at one that is not there."""

from hybridgnn.cli.main import main
from hybridgnn.testing.server import free_port


def test_bench_against_a_server_that_is_down_is_one_line_and_exit_2(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--url", url, "--duration-s", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hybridgnn bench: error: cannot load {url}") and err.count("\n") == 1
