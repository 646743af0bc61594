"""`serve --ranks HOST:PORT` with no rank 0 there: the server says what it waits for
(it waited up to 10 minutes without a line, not listening for HTTP meanwhile)."""

import logging
import time
from types import SimpleNamespace

import pytest

from hybridgnn.errors import ConfigError
from hybridgnn.serving.partitions import RankGroup
from tests.support.server import free_port


def test_waiting_for_remote_ranks_says_so(caplog):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there; below the ephemeral range, so no self-connect
    cfg = SimpleNamespace(partitions=SimpleNamespace(partitions=2, ranks=address), dataset_dir=None, model_dir=None)
    group = RankGroup(cfg)
    with caplog.at_level(logging.WARNING, logger="hybridgnn.serve"), pytest.raises(ConfigError, match="did not answer"):
        group._connect(time.monotonic() + 2.6)
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"waiting for partition rank 0 at {address}" in line and "hybridgnn rank" in line for line in lines)
