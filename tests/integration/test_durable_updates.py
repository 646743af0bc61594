"""Acknowledged graph updates survive kill -9: a real server, a stream of updates, kill
-9 at random points, restart, and every acknowledged update is there whole; the one in
flight at the kill, retried with its Idempotency-Key, is applied exactly once."""

import random
import shutil

import pytest

from tests.support.durability import (
    UpdateStream,
    check_after_restart,
    get_json,
    graph_state,
    send_update,
)
from tests.support.server import (
    FRONTEND_IDS,
    FRONTENDS,
    ServerProcess,
    await_ready,
    metrics_text,
)

TOKEN = "durable-token-123"


@pytest.mark.parametrize("frontends", FRONTENDS, ids=FRONTEND_IDS)
def test_acknowledged_updates_survive_kill_9_and_none_is_half_applied(tiny_dataset, tiny_model_pe, tmp_path,
                                                                      frontends):
    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset)  # the default log lives beside the dataset: keep the shared one clean
    flags = ("--workers", "1", "--update-token", TOKEN, "--frontends", frontends)
    srv = ServerProcess(dataset, tiny_model_pe, *flags).wait_ready()
    base = graph_state(srv.url)
    rng = random.Random(7)
    acked: list[int] = []
    try:
        for kill in range(3):
            stream = UpdateStream(srv.url, TOKEN, base["num_nodes"], base["feature_dim"], seed=kill)
            stream.start()
            want = len(acked) + rng.randrange(3, 25)
            while len(acked) + len(stream.acked) < want and stream.is_alive():
                stream.join(0.01)
            stream.killed.set()
            srv.proc.kill()  # kill -9 with updates in flight
            srv.proc.wait(30)
            stream.join(30)
            assert not stream.refused, (stream.refused[:3], srv.output()[-3000:])
            acked += stream.acked
            srv = ServerProcess(dataset, tiny_model_pe, *flags, port=srv.port)
            await_ready(srv, "restarted server", 120)
            if stream.in_flight is not None:  # unanswered when killed: the retry with its key applies it once
                status, out = send_update(srv.url, TOKEN, *stream.in_flight)
                assert status == 200, out
                acked += out["new_node_ids"]
                again, out2 = send_update(srv.url, TOKEN, *stream.in_flight)
                assert again == 200 and out2["replayed"] and out2["new_node_ids"] == out["new_node_ids"]
            problems = check_after_restart(srv.url, base, acked, exact=True)
            assert not problems, problems
            params = get_json(srv.url, "/v2/models/hybridgnn")[1]["parameters"]
            assert params["update_log_position"] == params["graph_version"] == len(acked)  # one batch each
            assert f"hybridgnn_update_log_position {float(len(acked))}" in metrics_text(srv.url)
            assert (dataset / "updates.sqlite").is_file()
    finally:
        srv.stop()
    assert len(acked) >= 9
