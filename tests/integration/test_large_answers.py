"""Large answers over a real server: encoded beside the event loop (in pieces, joined
once), they hold the values the same rows get in small answers encoded inline, through
the engine's own HTTP server and through front-end processes."""

import numpy as np
import pytest

from tests.support.durability import post_json
from tests.support.server import FRONTEND_IDS, FRONTENDS, ServerProcess

MODEL = "hybridgnn"


def lookup(url: str, ids: list[int]) -> dict[str, np.ndarray]:
    status, out = post_json(url, f"/v2/models/{MODEL}/infer", {
        "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}],
        "parameters": {"mode": "precomputed"}}, timeout_s=60)
    assert status == 200, out
    return {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in out["outputs"]}


@pytest.mark.parametrize("frontends", FRONTENDS, ids=FRONTEND_IDS)
def test_a_largest_answer_holds_the_rows_small_answers_hold(tiny_dataset, tiny_model_pe, frontends):
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--frontends", frontends).wait_ready()
    try:
        ids = np.random.default_rng(3).integers(0, 3000, 8192).tolist()  # the most a request may name
        big = lookup(srv.url, ids)
        assert sum(a.size for a in big.values()) >= 1 << 17  # past OFF_LOOP_VALUES: encoded off the loop
        small = [lookup(srv.url, ids[i:i + 64]) for i in range(0, len(ids), 64)]
        for name, arr in big.items():
            assert np.array_equal(arr, np.concatenate([s[name] for s in small])), name
        assert "Traceback" not in srv.output(), srv.output()[-2000:]
    finally:
        srv.stop()
