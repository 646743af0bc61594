"""Sampled inference, the engine's main path: a request is admitted by its PSGS, joins a
micro-batch, the batch is routed (the router's plan) to a pipeline, and its result is
sliced back to each request, whose on_done is called in the call that completes the
batch. Part of Engine (a base class of it, so the path reads as one piece); event loop
thread, except _on_batch_done (a worker thread)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np

from hybridgnn.errors import BatchFailed, RemovedNode
from hybridgnn.scheduler.admission import full_batch_work
from hybridgnn.serving.core.eager import EagerFuture, together
from hybridgnn.types import (
    Batch,
    BatchResult,
    InferenceRequest,
    RequestResult,
    RoutePlan,
)

log = logging.getLogger("hybridgnn.serving.core.engine")
OnDone = Callable[[RequestResult | None, BaseException | None], None]


class SampledInference:
    """What Engine sets up for this path: _tables, _batcher, _router, _pipelines,
    _admission, _sampled_lane, _control, _placement, _loop and the PSGS means."""

    def submit(self, node_ids: np.ndarray, on_done: OnDone | None = None, waited_s: float = 0.0):
        """Admit one request (ids already validated) or raise Overloaded / Draining; its
        answer goes to on_done(result, error), called once on the loop, in the call that
        completes its batch (without on_done: to the EagerFuture returned). waited_s: how
        long it already waited in the front end."""
        psgs = self._tables.batch_psgs(node_ids)
        predicted = self.admit("sampled", psgs, waited_s)
        self._mean_request_psgs += 0.01 * (psgs - self._mean_request_psgs)
        if node_ids.shape[0]:
            self._admitted_seed_psgs += 0.01 * (psgs / node_ids.shape[0] - self._admitted_seed_psgs)
        requests = self._control.count_admitted(int(node_ids.shape[0]))
        if not requests & 255:  # the batch size under backlog follows the request mix
            self._sampled_lane.full_batch = self._full_batch_psgs()
        fut = None
        if on_done is None:
            fut = EagerFuture(loop=self._loop)
            on_done = functools.partial(_settle, fut)
        self._batcher.add(InferenceRequest(node_ids=node_ids, on_done=on_done, arrival_s=time.perf_counter(),
                                           psgs=psgs, predicted_wait_s=predicted, waited_s=waited_s))
        return fut

    def _full_batch_psgs(self) -> float:
        b = self._batcher.cfg
        return full_batch_work(b.max_batch_psgs, b.max_batch_seeds, b.max_batch_requests, self._seed_psgs,
                               self._mean_request_psgs)

    def _has_capacity(self) -> bool:
        return any(p.depth <= p.capacity for p in self._pipelines.values())

    def _is_quiet(self) -> bool:
        """No batch is queued or running in any pipeline: one dispatched now starts at once,
        and no batch that could have taken more requests is under way."""
        return all(p.depth == 0 for p in self._pipelines.values())

    def _dispatch(self, batch: Batch) -> None:
        try:
            self._placement.count(batch.seeds)
            # Requests carry their PSGS (always >= 1 per seed) when the batcher bounds it: no
            # second lookup, unless a request was admitted before a bound was set.
            batch.psgs = (sum(r.psgs for r in batch.requests) if all(r.psgs > 0 for r in batch.requests)
                          else self._tables.batch_psgs(batch.seeds))
            self._submit_to(batch, self._router.route(batch.psgs, {n: p.load() for n, p in self._pipelines.items()}))
        except Exception as exc:
            log.exception("could not dispatch a batch of %d requests", len(batch.requests))
            self._fail(batch, exc)

    def _submit_to(self, batch: Batch, plan: RoutePlan) -> None:
        self.stats.routed(plan.pipeline, plan.reason)
        self._pipelines[plan.pipeline].submit(batch, plan)

    def _on_batch_done(self, batch: Batch, plan: RoutePlan, result: BatchResult | None, error: BaseException | None):
        # Called on a worker thread, or on the loop (worker processes); the loop owns the
        # answers. The time is taken here: a busy loop runs completions late and in bursts,
        # and admission's throughput and waits must see when batches finished, not when the
        # loop got to them. (call_soon on the loop's own thread measured no faster.)
        self._loop.call_soon_threadsafe(self._complete, batch, plan, result, error, time.perf_counter())

    def _fail(self, batch: Batch, error: BaseException) -> None:
        failure = BatchFailed(f"{type(error).__name__}: {error}")
        for req in batch.requests:
            self._resolve(req, exception=failure)

    def _complete(self, batch: Batch, plan: RoutePlan, result: BatchResult | None, error: BaseException | None,
                  done_s: float | None = None):
        stats = self.stats
        self._batcher.capacity_freed()
        if error is not None:
            stats.batch_failed(plan.pipeline)
            try:
                retry = self._router.fallback(plan)
            except LookupError:
                retry = None
            if retry is None:
                self._fail(batch, error)
                return
            try:
                self._submit_to(batch, retry)
            except Exception as exc:  # the fallback is stopped (a drain) or refuses: answer now
                log.warning("could not fall back to %s after %s failed a batch: %s", retry.pipeline, plan.pipeline,
                            exc)
                self._fail(batch, error)
            return
        stats.batch_done(plan.pipeline, result.timings, batch.num_seeds, len(batch.requests), batch.psgs,
                         result.sampled_edges, result.gathered_rows)
        self.model_stats.executed()
        rt = result.timings
        service_s = rt.sample_s + rt.gather_s + rt.compute_s
        self._control.record(plan.pipeline, batch.psgs, service_s)
        lane = self._sampled_lane
        lane.observe(batch.psgs, service_s)
        # What each request waited before its batch's service began, against what
        # admission predicted: the calibration that makes the bound hold for the tail.
        # The wait is charged up to now, not done_s: a client waits for the loop too.
        now = time.perf_counter()
        done_s = now if done_s is None else done_s
        service_began = now - service_s
        # the rest of its time since submit: hand-offs to the pipeline's thread, a worker
        # process and back, and the loop's wake-up to this completion (no stage held it)
        stats.stage("handoff", plan.pipeline, max(0.0, now - batch.submitted_s - rt.queue_wait_s - service_s))
        admission = self._admission
        bound = admission.bound_s
        slo = admission.slo is not None
        offs = batch.offsets.tolist()  # Python ints slice faster than numpy scalars
        logits, embeddings, predictions, removed = result.logits, result.embeddings, result.predictions, result.removed
        pipeline, timings, closed_s = plan.pipeline, result.timings, batch.closed_s
        with together():  # the batch's answers are made first, then leave back to back
            for i, req in enumerate(batch.requests):
                lane.calibrate(req.predicted_wait_s, service_began - req.arrival_s, bound)
                if slo:
                    admission.observe_latency(req.waited_s + now - req.arrival_s)
                stats.stage("batching", pipeline, closed_s - req.arrival_s)
                lo, hi = offs[i], offs[i + 1]
                if removed is not None and removed[lo:hi].any():
                    self._resolve(req, exception=RemovedNode.among(batch.seeds[lo:hi][removed[lo:hi]]))
                    continue
                self._resolve(req, RequestResult(logits[lo:hi], embeddings[lo:hi], predictions[lo:hi], pipeline,
                                                 timings))
        lane.completed(batch.psgs, done_s)

    def _resolve(self, req: InferenceRequest, result: RequestResult | None = None, exception=None) -> None:
        # The books first: on_done may answer at once, and what that answer lets in (a
        # pipelined request) must see this request gone.
        self._sampled_lane.remove(req.psgs)
        self.release()
        try:
            req.on_done(result, exception)
        except Exception as exc:  # as the loop treats a failing callback: report it, answer the rest
            self._loop.call_exception_handler({"message": "exception answering a request", "exception": exc})



def _settle(fut, result: RequestResult | None, error: BaseException | None) -> None:
    """Complete fut with a request's answer (unless it was cancelled)."""
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
