"""Refusals: one shared Reply per distinct refusal, found by its status, message and
headers (a front end decodes a new Failure from every answer the engine sends)."""

from __future__ import annotations

import json

from hybridgnn.serving.http.reply import Refusals
from hybridgnn.serving.v2.types import Failure


def test_equal_refusals_from_distinct_failures_share_one_reply():
    refusals = Refusals()
    first = refusals.reply_of(Failure(429, "server overloaded: queue full"))
    again = refusals.reply_of(Failure(429, "server overloaded: queue full"))
    assert again is first and first.shared and first.headers["Retry-After"]
    other = refusals.reply_of(Failure(429, "server overloaded: queue full", {"Retry-After": "5"}))
    assert other is not first and other.headers == {"Retry-After": "5"}
    assert refusals.reply_of(Failure(503, "server overloaded: queue full")) is not first


def test_other_errors_are_not_shared_and_a_bug_keeps_its_request_id():
    refusals = Refusals()
    bad = refusals.reply_of(Failure(400, "node id 9 is out of range"))
    assert not bad.shared and refusals.reply_of(Failure(400, "node id 9 is out of range")) is not bad
    bug = refusals.reply_of(Failure(500, "internal server error", None, "abc123"))
    assert json.loads(bug.body) == {"error": "internal server error", "request_id": "abc123"}
