"""A front-end process's API (serving/frontend.py) against a fake engine link, and how
many front ends `auto` is."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from hybridgnn.config import parse_frontends
from hybridgnn.serving.core.eager import Later
from hybridgnn.serving.frontend import FrontendApi
from hybridgnn.serving.frontend_link import FrontendLink
from hybridgnn.serving.frontends import (
    Frontends,
    connection_share,
    frontends_for,
)
from hybridgnn.serving.http.reply import Reply, Request
from hybridgnn.serving.ipc import wire
from hybridgnn.serving.v2.types import Failure, InferAnswer


class FakeLink:
    def __init__(self, up: bool = True):
        self.up = up
        self.sent: list[tuple[bytes, tuple]] = []
        self.notes: list[bytes] = []

    def request(self, make_frame, waiter) -> bool:
        if not self.up:
            return False
        self.sent.append((make_frame(len(self.sent) + 1), waiter))
        return True

    def note(self, data: bytes) -> None:
        self.notes.append(data)

    def answer(self, i: int, frame: bytes) -> Reply:
        later, answer, _ = self.sent[i][1]
        kind, rid = wire.FRAME.unpack_from(frame)[1:]
        later.set_result(answer(kind, memoryview(frame)[wire.FRAME.size:]))
        return later.result()


def infer_body(ids, **kw) -> bytes:
    return json.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}],
                       **kw}).encode()


def test_inference_is_routed_here_and_everything_else_forwarded():
    api = FrontendApi(FakeLink(), {"draining": False})
    endpoint, params = api.route("POST", "/v2/models/m/versions/3/infer")
    assert endpoint == api.infer and params == {"model": "m", "version": "3"}
    for method, path in (("GET", "/v2/models/m/infer"), ("GET", "/v2/health/ready"), ("POST", "/v2/models/m/graph"),
                         ("POST", "/v2/repository/index"), ("GET", "/nope")):
        endpoint, params = api.route(method, path)
        assert endpoint.func == api.forward and endpoint.args == (method, path) and params == {}
    assert api.route("POST", "/v2/models/m%20x/infer") == (api.infer, {"model": "m x"})


def test_an_inference_crosses_as_arrays_and_its_answer_is_encoded_as_asked():
    link = FakeLink()
    api = FrontendApi(link, {})
    out = api.infer(Request({"model": "m"}, {}, infer_body([4, 5], outputs=[
        {"name": "logits", "parameters": {"binary_data": True}}]), 0.01))
    assert isinstance(out, Later) and not out.done()
    frame, _ = link.sent[0]
    sent = wire.decode_infer(memoryview(frame)[wire.FRAME.size:])
    assert sent.inputs[0].data.tolist() == [4, 5] and sent.waited_s == 0.01 and sent.outputs == ["logits"]
    logits = np.arange(4, dtype=np.float32).reshape(2, 2)
    reply = link.answer(0, wire.encode_answer(1, InferAnswer("m", "1", None, [("logits", logits)])))
    assert reply.status == 200 and reply.content_type == "application/octet-stream"
    assert reply.body.endswith(logits.tobytes())


def test_a_failure_from_the_engine_is_answered_with_its_status_and_headers():
    link = FakeLink()
    api = FrontendApi(link, {})
    api.infer(Request({"model": "m"}, {}, infer_body([1])))
    reply = link.answer(0, wire.encode_failure(1, Failure(429, "too much", {"Retry-After": "2"})))
    assert reply.status == 429 and reply.headers == {"Retry-After": "2"} and b"too much" in reply.body


def test_a_body_that_does_not_parse_is_answered_here_and_counted_there():
    link = FakeLink()
    api = FrontendApi(link, {})
    reply = api.infer(Request({"model": "m", "version": "2"}, {}, b"{not json"))
    assert reply.status == 400 and b"not valid JSON" in reply.body and not link.sent
    kind = wire.FRAME.unpack_from(link.notes[0])[1]
    assert kind == wire.UNPARSED and wire.loads(memoryview(link.notes[0])[wire.FRAME.size:]) == {
        "model": "m", "version": "2", "status": 400}


def test_too_many_ids_for_the_engines_model_are_refused_here_as_there_before_the_copy():
    # 1.9M ids were converted and copied to the engine only to be refused there
    link = FakeLink()
    api = FrontendApi(link, {"id_limit": ["m", "1", 100]})
    for version in (None, "1"):
        reply = api.infer(Request({"model": "m", "version": version}, {}, infer_body(list(range(101)))))
        assert reply.status == 400 and b"node_ids holds 101 ids; at most 100 per request" in reply.body
    assert not link.sent and [wire.loads(memoryview(n)[wire.FRAME.size:])["status"] for n in link.notes] == [400, 400]
    assert isinstance(api.infer(Request({"model": "m"}, {}, infer_body(list(range(100))))), Later)
    # another model or version: the engine's answer (a 404), not this one's
    for params in ({"model": "other"}, {"model": "m", "version": "2"}):
        assert isinstance(api.infer(Request(params, {}, infer_body(list(range(101))))), Later)
    assert len(link.sent) == 3


def test_without_an_engine_requests_are_refused_503():
    api = FrontendApi(FakeLink(up=False), {})
    assert api.infer(Request({"model": "m"}, {}, infer_body([1]))).status == 503
    assert api.forward("GET", "/v2", Request({}, {}, b"")).status == 503



def test_inferences_refused_while_the_engine_is_quiet_are_counted_by_it_when_it_reads_again():
    """A front end whose engine was stopped (SIGSTOP, hung) answered inferences 503 that
    reached no counter: a stalled replica's 503s were missing from
    hybridgnn_requests_total and its error ratio. They are kept here by model and version
    (client names past a bound as of no model) and sent once the engine reads again."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from hybridgnn.errors import NotFound
    from hybridgnn.serving.v2.service import V2Service
    from hybridgnn.telemetry.metrics import Telemetry

    link = FakeLink(up=False)
    api = FrontendApi(link, {})
    for params in ({"model": "m"}, {"model": "m"}, {"model": "m", "version": "2"}):
        assert api.infer(Request(params, {}, infer_body([1]))).status == 503
    for i in range(100):  # made-up model names hold no memory
        api.infer(Request({"model": f"x{i}"}, {}, infer_body([1])))
    assert len(api.unanswered) <= 65
    assert not link.notes  # nothing sent toward an engine that does not read
    api.send_counts()
    notes = [wire.loads(memoryview(n)[wire.FRAME.size:]) for n in link.notes]
    assert {(n["model"], n["version"]): n["count"] for n in notes if n["model"] == "m"} == {("m", None): 2,
                                                                                          ("m", "2"): 1}
    assert sum(n["count"] for n in notes) == 103 and {n["status"] for n in notes} == {503}
    api.send_counts()
    assert len(link.notes) == len(notes)  # each counted once

    # the engine counts them as it counts an inference answered elsewhere: under the model
    # and version asked for when it serves them, else its own
    telemetry = Telemetry(model="m")
    engine = SimpleNamespace(stats=telemetry.for_model("m", "1"), model_stats=SimpleNamespace(failed=lambda s: None))

    class Models:
        def get(self, name, version=None):
            if name == "m" and version in (None, "1"):
                return engine
            raise NotFound(f"no model {name} {version}")

        def engines(self):
            return [engine]

    service = object.__new__(V2Service)
    service.models, service.engine, service.repository = Models(), engine, object()  # no lookups to hand out
    hub = Frontends(type("FakeApi", (), {"service": service, "engine": engine})(), cfg=None, count=1)

    async def linked() -> FrontendLink:
        return FrontendLink(hub)

    engine_side = asyncio.run(linked())
    for frame in link.notes:
        engine_side._on_message(wire.UNPARSED, 0, memoryview(frame)[wire.FRAME.size:])
    text = telemetry.exposition()[0].decode()
    assert {s.labels["code"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "hybridgnn_requests_total" and s.value} == {"503": 103.0}

def test_front_end_counters_never_go_down_across_its_restarts():
    """A restarted front end reports from zero: /metrics adds up its processes, so its
    requests, CPU and refused connections stay counted while it is down and after."""
    class NoService:
        repository = object()  # no lookups to hand out

    from hybridgnn.telemetry.metrics import Telemetry

    engine = type("E", (), {"stats": Telemetry()})()  # the refusals its reports add up (counted elsewhere)
    hub = Frontends(type("FakeApi", (), {"service": NoService(), "engine": engine})(), cfg=None, count=2)

    async def linked() -> FrontendLink:  # a link's channel is made on the event loop
        return FrontendLink(hub)

    def process(index: int, requests: int, cpu_s: float, refused: int) -> FrontendLink:
        link = asyncio.run(linked())
        link.index = index
        hub.links[index] = link
        stats = wire.json_frame(wire.STATS, 0, {"connections": 3, "requests": requests, "cpu_s": cpu_s,
                                                "refused_connections": refused, "rss_bytes": 1})
        link._on_message(wire.STATS, 0, memoryview(stats)[wire.FRAME.size:])
        return link

    process(0, 40, 2.0, 5)._on_lost(None)
    down = hub.reports()[0]
    assert (down["requests"], down["cpu_s"], down["refused_connections"], down["up"]) == (40, 2.0, 5, False)
    assert down.get("connections", 0) == 0  # gauges are the process's own
    process(0, 1, 0.5, 0)
    back = hub.reports()
    assert (back[0]["requests"], back[0]["cpu_s"], back[0]["refused_connections"]) == (41, 2.5, 5)
    assert back[0]["connections"] == 3 and back[0]["up"]
    assert back[1]["requests"] == 0 and not back[1]["up"]


@pytest.mark.parametrize("key, reason", [(wire.GRPC_REFUSED, "grpc_call_cap"),
                                         ("refused_connections", "connection_cap")])
def test_refusals_at_front_ends_are_counted_by_the_engine_across_restarts(key, reason):
    """Each front end's gRPC call-cap and connection-cap refusals reached no refusal series:
    the engine now adds what each report says is new to
    hybridgnn_rejected_requests_total{reason="grpc_call_cap" / "connection_cap"}."""
    from prometheus_client.parser import text_string_to_metric_families

    from hybridgnn.telemetry.metrics import Telemetry

    class NoService:
        repository = object()

    stats = Telemetry()
    hub = Frontends(type("FakeApi", (), {"service": NoService(), "engine": type("E", (), {"stats": stats})()})(),
                    cfg=None, count=2)

    async def linked() -> FrontendLink:
        return FrontendLink(hub)

    def report(link: FrontendLink, refused: int) -> None:
        frame = wire.json_frame(wire.STATS, 0, {"requests": 1, key: refused})
        link._on_message(wire.STATS, 0, memoryview(frame)[wire.FRAME.size:])

    def counted() -> float:
        text = stats.exposition()[0].decode()
        return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "hybridgnn_rejected_requests_total" and s.labels == {"reason": reason}), 0)

    first, second = asyncio.run(linked()), asyncio.run(linked())
    report(first, 0)
    report(first, 3)
    report(first, 3)  # nothing new
    report(second, 2)
    assert counted() == 5
    first._on_lost(None)
    report(asyncio.run(linked()), 4)  # front end 0 started again: its new process counts from zero
    assert counted() == 9


def test_auto_front_ends_follow_the_cores():
    assert [frontends_for(None, c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 8]
    assert frontends_for(3, 2) == 3
    assert parse_frontends("auto") is None and parse_frontends(" 4 ") == 4
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError):
            parse_frontends(bad)


def test_fewer_front_ends_than_asked_for_are_said_in_the_log(caplog):
    with caplog.at_level("WARNING", logger="hybridgnn.serve"):
        assert frontends_for(4, 16, 2) == 2 and frontends_for(None, 64, 3) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "--frontends 4: starting 2, as many as --max-connections 2 gives a connection each"]


def test_the_front_ends_connection_shares_add_up_to_the_cap():
    # --max-connections 1 --frontends 2 held 2 connections (max(1, 1 // 2) each); 21 over 2 held 20
    for cap in (1, 2, 3, 7, 21, 10_000):
        for wanted in (2, 3, 8):
            count = frontends_for(wanted, 64, cap)
            shares = [connection_share(cap, count, i) for i in range(count)]
            assert sum(shares) == cap and min(shares) >= 1, (cap, wanted, shares)
    assert frontends_for(None, 64, 3) == 3 and frontends_for(4, 2, 10_000) == 4


def test_a_containers_cpu_quota_bounds_the_cores_auto_counts(tmp_path):
    from hybridgnn.capabilities import cpu_quota_cores

    assert cpu_quota_cores(str(tmp_path)) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota_cores(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota_cores(str(tmp_path)) == 2.5
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota_cores(str(tmp_path)) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("800000\n")
    assert cpu_quota_cores(str(tmp_path)) == 8.0


def test_data_nested_too_deep_to_write_again_is_refused_here(monkeypatch):
    link = FakeLink()
    api = FrontendApi(link, {})

    def too_deep(rid, inp):
        raise RecursionError("maximum recursion depth exceeded while encoding a JSON object")

    monkeypatch.setattr(wire, "encode_infer", too_deep)
    reply = api.infer(Request({"model": "m"}, {}, infer_body([1])))
    assert reply.status == 400 and b"nested too deeply" in reply.body and not link.sent
    assert wire.FRAME.unpack_from(link.notes[0])[1] == wire.UNPARSED


def test_a_front_end_that_cannot_be_made_again_is_tried_again_with_backoff(monkeypatch, caplog):
    # An OSError making the process (out of processes or descriptors) ended the watcher,
    # unlogged: that front end was never started again.
    import asyncio
    import time

    from hybridgnn.serving import frontends as fe

    monkeypatch.setattr(fe, "_RESTART_BACKOFF_S", (0.0, 0.001, 0.002))

    class Dead:
        pid, returncode = 4242, -9

        async def wait(self):
            return -9

    class Running(Dead):
        async def wait(self):
            await asyncio.Event().wait()

    group = object.__new__(fe.Frontends)
    group._stopping, group._procs, group._started_at, group.restarts = False, [Dead()], [0.0], [0]
    attempts = []

    async def start_one(index):
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise OSError(24, "Too many open files")
        group._procs[index] = Running()

    group._start_one = start_one

    async def scenario():
        watcher = asyncio.create_task(group._restart_when_dead(0))
        deadline = time.monotonic() + 10
        while not group.restarts[0]:
            assert time.monotonic() < deadline and not watcher.done(), "the watcher gave up"
            await asyncio.sleep(0.001)
        watcher.cancel()

    with caplog.at_level("ERROR", logger="hybridgnn.serve"):
        asyncio.run(scenario())
    assert len(attempts) == 3 and group.restarts == [1]
    assert sum("could not be started again: [Errno 24]" in r.getMessage() for r in caplog.records) == 2


def test_quiet_counts_only_ticks_that_ran_on_time():
    from hybridgnn.serving.ipc.channel import Quiet

    q = Quiet(period_s=1.0, limit_s=3.0)
    assert [q.tick(t) for t in (0.0, 1.0, 2.0)] == [False, False, False]  # heard before 0.0
    assert q.tick(3.0) and q.quiet  # 0.0..3.0: three seconds of on-time ticks, nothing heard
    assert not q.tick(4.0)  # says so once
    assert q.spoke() and not q.quiet and not q.spoke()
    # this end stalled (stopped, its loop blocked): a late tick starts the count again,
    # since the other end's frames may be waiting unread
    q = Quiet(period_s=1.0, limit_s=3.0)
    q.heard = False
    assert [q.tick(t) for t in (0.0, 1.0, 2.0, 60.0, 61.0, 62.0)] == [False] * 6
    assert q.tick(63.0)
    q = Quiet(period_s=1.0, limit_s=3.0)
    assert [q.tick(t) for t in (0.0, 1.0, 2.0)] == [False] * 3
    q.spoke()  # heard in time: the count starts again
    assert [q.tick(t) for t in (3.0, 4.0, 5.0)] == [False] * 3 and q.tick(6.0)


def test_a_quiet_engine_answers_what_waits_for_it_and_its_late_answers_are_dropped(caplog, monkeypatch):
    """An engine process that lives but does not speak (SIGSTOP, hung): what waits for it
    is answered 503 (a state change: its connection aborted), new requests are refused at
    once, nothing piles up unsent; when it speaks again its answers to what was answered
    here are dropped, not taken for a broken link, and requests flow again."""
    from hybridgnn.serving.frontend import EngineLink
    from hybridgnn.serving.http.reply import ABORT

    sent = []

    class Transport:
        def write(self, data):
            sent.append(bytes(data))

        def close(self):
            pass

    import hybridgnn.serving.frontend as fe_mod

    clock = iter(range(100, 200))  # the link's tick reads time.monotonic: a clock of one-second ticks

    states = []

    async def run():
        link = EngineLink(states.append, lambda exc: None)
        link.channel.connection_made(Transport())
        api = FrontendApi(link, {"draining": False})
        read = api.forward("GET", "/v2/health/ready", Request({}, {}, b""))
        change = api.forward("POST", "/v2/models/m/graph", Request({}, {}, b"{}"))
        infer = api.infer(Request({"model": "m"}, {}, infer_body([1, 2])))
        assert all(isinstance(x, Later) for x in (read, change, infer)) and len(sent) == 3
        monkeypatch.setattr(fe_mod.time, "monotonic", lambda: float(next(clock)))
        for _ in range(int(wire.QUIET_S) + 2):
            link.tick()
        monkeypatch.undo()
        assert link.quiet.quiet and states == [{"quiet": True}]  # the front end's lookups stop too
        assert read.result().status == 503 and infer.result().status == 503 and change.result() is ABORT
        assert b"not answering" in read.result().body
        assert api.infer(Request({"model": "m"}, {}, infer_body([3]))).status == 503  # refused at once
        link.note(b"dropped")
        assert len(sent) == 3  # nothing more written toward a process that reads nothing
        # it speaks again: its answer to the inference answered here is dropped
        rid = wire.FRAME.unpack_from(sent[2])[2]
        late = wire.encode_failure(rid, Failure(500, "late", {}))
        link.channel.data_received(late)
        assert not link.channel.closed and not link.quiet.quiet and states[-1] == {"quiet": False}
        again = api.infer(Request({"model": "m"}, {}, infer_body([4])))
        assert isinstance(again, Later) and len(sent) == 4

    with caplog.at_level("WARNING", logger="hybridgnn.frontend"):
        asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records]
    assert any("has not spoken for" in m for m in messages) and any("speaks again" in m for m in messages)


class _Proc:
    def __init__(self, pid: int):
        self.pid, self.returncode, self.killed = pid, None, False

    def kill(self):
        self.killed = True


class _NoTransport:
    def write(self, data):
        pass

    def close(self):
        pass


def _one_front_end(fe, ran):
    """A Frontends of front end 0 (pid 4242), listening and silent from now on; its event
    loop thread's CPU time is read from ran() (monkeypatched over /proc)."""
    from hybridgnn.serving.ipc.channel import Quiet

    group = object.__new__(fe.Frontends)
    proc = _Proc(4242)
    group._procs, group._beat_at = [proc], None
    link = FrontendLink(group)
    link.channel.connection_made(_NoTransport())
    link.index, link.pid, link.quiet = 0, 4242, Quiet(wire.KEEPALIVE_S, wire.QUIET_S)
    group.links = {0: link}
    return group, link, proc


def test_a_front_end_gone_quiet_is_killed_so_that_its_watcher_starts_it_again(caplog, monkeypatch):
    from hybridgnn.serving import frontends as fe

    monkeypatch.setattr(fe, "_loop_thread_cpu", lambda pid: 7)  # stopped: its loop thread does not run

    async def run():
        group, link, proc = _one_front_end(fe, None)
        killed_at = None
        for t in range(30):
            group._heartbeat(float(t))
            if proc.killed and killed_at is None:
                killed_at = t
        assert killed_at == wire.QUIET_S  # heard before 0: quiet at QUIET_S, its loop not seen running since 1
        proc.killed, link.pid = False, 1  # a link of an earlier process never kills the new one
        group._kill_quiet(link)
        assert not proc.killed

    with caplog.at_level("ERROR", logger="hybridgnn.serve"):
        asyncio.run(run())
    assert "front end 0 (pid 4242) has not spoken for 10 s; killing it" in caplog.text


def test_a_silent_front_end_whose_loop_runs_is_busy_not_hung(caplog, monkeypatch):
    """Large requests arriving together hold a front end's loop for seconds each: silent
    past the quiet limit, it was killed with every connection it held. Its loop thread
    running shows it busy; it is waited for (up to _BUSY_LIMIT_S), and killed once its
    loop has not run for _STILL_S."""
    from hybridgnn.serving import frontends as fe

    ran = [0]
    monkeypatch.setattr(fe, "_loop_thread_cpu", lambda pid: ran[0])

    async def run():
        group, link, proc = _one_front_end(fe, ran)
        for t in range(40):  # busy, silent
            ran[0] += 100
            group._heartbeat(float(t))
        assert not proc.killed and link.quiet.quiet
        link.channel.data_received(wire.json_frame(wire.STATS, 0, {"connections": 1}))  # it speaks again
        assert not link.quiet.quiet
        for t in range(40, 40 + int(wire.QUIET_S)):  # stopped now: its loop thread does not run
            group._heartbeat(float(t))
        assert not proc.killed
        group._heartbeat(40 + wire.QUIET_S)
        assert proc.killed
        # busy, then stuck without a word: killed once its loop has not run for _STILL_S
        group, link, proc = _one_front_end(fe, ran)
        for t in range(15):
            ran[0] += 100
            group._heartbeat(float(t))
        for t in range(15, 14 + int(fe._STILL_S)):  # its loop last seen running at 14
            group._heartbeat(float(t))
        assert not proc.killed
        group._heartbeat(14 + fe._STILL_S)
        assert proc.killed
        # busy for ever (a loop that never returns): killed after _BUSY_LIMIT_S of silence
        group, link, proc = _one_front_end(fe, ran)
        t = 0
        while not proc.killed:
            ran[0] += 100
            group._heartbeat(float(t))
            t += 1
        assert t - 1 == fe._BUSY_LIMIT_S  # heard before 0

    with caplog.at_level("WARNING", logger="hybridgnn.serve"):
        asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records]
    assert sum("but its event loop is running" in m and "waiting for it" in m for m in messages) == 3, messages
    assert sum("speaks again" in m for m in messages) == 1
    assert sum("killing it" in m for m in messages) == 3
    assert "has not spoken for 60 s though its event loop is running" in messages[-1]


def test_a_heartbeat_that_comes_late_judges_no_front_end(monkeypatch):
    """This process stalled (stopped, its loop blocked): the front ends' frames may wait
    unread behind the heartbeat, so their silence is counted again from there."""
    from hybridgnn.serving import frontends as fe

    monkeypatch.setattr(fe, "_loop_thread_cpu", lambda pid: 7)  # idle (or stopped)

    async def run():
        group, link, proc = _one_front_end(fe, None)
        for t in range(int(wire.QUIET_S) - 1):
            group._heartbeat(float(t))
        group._heartbeat(60.0)  # late: nothing is judged, the count starts again
        for t in range(61, 60 + int(wire.QUIET_S)):
            group._heartbeat(float(t))
        assert not proc.killed
        group._heartbeat(60 + wire.QUIET_S)
        assert proc.killed

    asyncio.run(run())


def test_a_large_frame_arriving_in_pieces_is_the_front_end_speaking(monkeypatch):
    """A large request crosses in many reads, and the front end's keep-alives wait behind
    it: each piece shows the front end writing (it was silent until the frame ended)."""
    from hybridgnn.serving import frontends as fe

    monkeypatch.setattr(fe, "_loop_thread_cpu", lambda pid: 7)  # it would be killed if found quiet

    async def run():
        group, link, proc = _one_front_end(fe, None)
        big = wire.json_frame(wire.STATS, 0, {"connections": 1, "pad": "x" * 4000})
        pieces = [big[i:i + 100] for i in range(0, len(big), 100)]
        for t, piece in enumerate(pieces):
            link.channel.data_received(piece)
            group._heartbeat(float(t))
            assert not link.quiet.quiet and not proc.killed, t
        assert link.report["connections"] == 1 and not link.channel.closed

    asyncio.run(run())


def test_the_engine_speaks_to_front_ends_that_listen_while_the_others_still_start(monkeypatch, tmp_path):
    """The keep-alives began only once every front end listened: a front end up first
    heard nothing while a slower one started, and after 10 s took the engine for hung
    (503 to everything, readiness included) though it served all along."""
    from types import SimpleNamespace

    from hybridgnn.serving import frontends as fe
    from hybridgnn.serving.ipc.channel import Quiet

    class Held:
        def getsockname(self):
            return ("127.0.0.1", 8000)

        def close(self):
            pass

    heard = []

    class Transport(_NoTransport):
        def write(self, data):
            heard.append(wire.FRAME.unpack_from(data)[1])

    monkeypatch.setattr(fe, "reserve_port", lambda host, port: Held())
    monkeypatch.setattr(fe, "private_run_dir", lambda kind: str(tmp_path))
    service = SimpleNamespace(repository=object())
    stats = SimpleNamespace(frontends=lambda reports: None, refused=lambda reason, count=1: None)
    api = SimpleNamespace(service=service, engine=SimpleNamespace(stats=stats))
    cfg = SimpleNamespace(server=SimpleNamespace(host="127.0.0.1", port=0, grpc_port=None))

    async def run():
        loop = asyncio.get_running_loop()

        async def no_server(factory, path):
            return SimpleNamespace(close=lambda: None)

        monkeypatch.setattr(loop, "create_unix_server", no_server)
        group = fe.Frontends(api, cfg, 2)

        async def start_one(index):
            if index == 0:  # up at once
                link = FrontendLink(group)
                link.channel.connection_made(Transport())
                link.index, link.pid, link.quiet = 0, 4242, Quiet(wire.KEEPALIVE_S, wire.QUIET_S)
                group.links[0] = link
                return
            deadline = loop.time() + 3 * wire.KEEPALIVE_S  # the slow one: front end 0 hears the engine meanwhile
            while wire.ALIVE not in heard and loop.time() < deadline:
                await asyncio.sleep(0.01)

        group._start_one = start_one
        group._watch = lambda index: None
        await group.start()
        assert wire.ALIVE in heard
        group.begin_shutdown()
        for task in list(group._watchers):
            task.cancel()

    asyncio.run(run())
