"""The backend of a stage server: serving one call or a merged group (:mod:`.batching`), kept activations,
at-most-once backwards.

See :mod:`.server` for the picture."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_swarm.swarm.server.applied import AppliedRequests, TooLate
from lightning_swarm.swarm.server.batching import (
    RequestBatcher,
    concat_payloads,
    merge_key,
    mixes_rows,
    split_payload,
)
from lightning_swarm.swarm.server.compute import (
    Kept,
    all_finite,
    buffers_kept,
    exclusive,
    leaves_of,
    module_device,
    seeded_rng,
)
from lightning_swarm.swarm.server.shared import KeptForwards, SharedState
from lightning_swarm.swarm.server.weight_grads import (
    DeferredWeights,
    WeightWork,
    split_backward,
    split_enabled,
)
from lightning_swarm.swarm.settings import SwarmSettings
from lightning_swarm.swarm.throughput import Throughput
from lightning_swarm.swarm.wire.codec import CodecError, check_encodable
from lightning_swarm.swarm.wire.errors import (
    COMPUTE,
    REQUEST,
    UNAVAILABLE,
    BadRequest,
    ErrorReply,
    Misrouted,
    NotKept,
)
from lightning_swarm.swarm.wire.guards import StageSchemas, check_finite, check_grad_outputs, check_outputs
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageReply, StageRequest, stage_uid

logger = logging.getLogger(__name__)

# a merged forward keeps no activations, so each of its calls' backwards recomputes it: a training forward whose
# forward takes longer than this (per call, measured) is served alone and keeps its activations (see _merge_key).
# Measured on the 2-core box: with 12 ms forwards merging still served 1.2x more samples/s than keeping
# (benchmarks/batched_stage.py --quick: it spares per-call work and runs larger products); with 400 ms forwards
# it served 3x fewer (benchmarks/swarm_rebalance.py, 12 calls in flight).
MERGE_FORWARD_MAX_S = 0.05
_FORWARD_EMA = 0.2  # weight of the newest forward in the measured forward seconds per row


class StageBackend:
    """The compute of a stage server (see :mod:`.server`): serves one call or a merged group of calls, keeps
    forwards for their backward, applies each backward at most once and adds its parameter gradients to the
    pending ones (in :class:`.shared.SharedState`, which the stepper takes them from).

    Args:
        stage: the stage index.
        module: the stage's blocks.
        settings: the swarm's settings (keep_activations, batching, autocast, stage_steps).
        shared: the state shared with the server's stepper.
        throughput: this server's measured throughput (each backward is recorded).
        catch_up: called with a request's epoch before it is served (a trainer-driven peer that missed steps
            loads the stage's state first, see ``Stepper.catch_up_for_call``).
        check_schema: refuse requests whose tensors fit none of the input schemas learned from the calls served
            so far (see :class:`~.guards.StageSchemas`).
    """

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        settings: SwarmSettings,
        shared: SharedState,
        throughput: Throughput,
        catch_up: Callable[[int | None], None],
        *,
        check_schema: bool = True,
    ) -> None:
        self.stage, self.module, self.settings, self.shared = stage, module, settings, shared
        self.uid = stage_uid(settings.run_id, stage)
        self.throughput, self.catch_up = throughput, catch_up
        self.driven = settings.stage_steps == "trainer"
        self.accepting = False  # whether calls are served (the server is started and not draining)
        self.batcher: RequestBatcher | None = None
        self.applied = (
            AppliedRequests()
        )  # the ids of the backwards applied here (under the shared grads_lock)
        # what the stage's calls look like, learned from the ones it served
        self.schemas = StageSchemas(max_schemas=4 if check_schema else 0)
        self.requests_served = 0  # forward and backward requests handed to the stage (batched or not)
        self.samples_processed = 0
        self.dropped_contributions = 0  # backwards whose parameter gradients were not finite
        self.kept_hits = 0  # backwards that reused a kept forward
        # runs of the stage module for them (a merged group runs it once); counted under the parameters lock
        self.computations = 0
        # (kind, start, end) of the stage's latest computations, on the monotonic clock (shared by the processes
        # of one machine): when this server's stage was busy
        self.compute_log: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=1024)
        self.draws_rng = False  # whether a train-mode run of the stage drew random numbers (learned, sticky)
        self._forward_s_per_row: float | None = None  # measured (see _merge_key)
        # the modes the module was built with (a train call runs in them; an eval call in eval), the mode it is in
        self._built_modes = [(m, m.training) for m in module.modules()]
        self._training = True
        # a trainer-driven stage after the first replies to a backward before its parameter gradients (.weight_grads)
        if self.driven and stage > 0 and split_enabled():
            waiting = lambda: 0 if self.batcher is None else self.batcher.pending()  # noqa: E731
            log = lambda *entry: self.compute_log.append(entry)  # noqa: E731
            most = max(settings.keep_activations, 1)
            shared.weights = DeferredWeights(shared.lock, waiting, f"stage{stage}-weights", most, log)

    @property
    def device(self) -> torch.device:
        """Where the stage module lives (inputs are moved there)."""
        return module_device(self.module)

    def start(self) -> bool:
        """Take calls from now on; returns whether they are batched (merged when they wait for the stage together,
        see :mod:`.batching`), which takes several serving threads."""
        s = self.settings
        batching = s.max_batch_rows > 0 and not mixes_rows(self.module)
        if s.max_batch_rows > 0 and not batching:
            logger.info(
                f"Stage {self.stage}: batch normalisation mixes the rows of a batch; calls are not merged"
            )
        if batching:
            self.batcher = RequestBatcher(
                self._serve_group,
                max_rows=s.max_batch_rows,
                wait_s=s.batch_wait_ms / 1000,
                key=self._merge_key,
            )
        return batching

    def close(self) -> None:
        """The server stopped serving: the module back in the modes it was built with (its blocks may be the
        trainer's own, put back when the run ends), kept forwards and deferred work dropped."""
        self.accepting = False
        with self.shared.lock:
            self._set_mode(True)
        if self.shared.weights is not None:
            self.shared.weights.close()
        self.shared.kept.clear()
        if self.batcher is not None:
            batcher, self.batcher = self.batcher, None
            batcher.close()

    # ---- serving a request (the same for in-process and remote callers) ----

    def handle(self, request: StageRequest) -> StageReply:
        """Serve one request; never raises: failures become error replies (see :mod:`.protocol`). With batching,
        the request waits for the compute thread, which may merge it with other waiting requests."""
        # a trainer that has not seen this peer migrate: another peer of the stage can serve it
        if request.uid != self.uid:
            error = Misrouted(f"This peer serves {self.uid!r}, but the request was for {request.uid[:200]!r}")
            return error_reply(request.request_id, UNAVAILABLE, error)
        try:
            if not self.accepting:
                return error_reply(
                    request.request_id, UNAVAILABLE, RuntimeError(f"Stage {self.stage} server is not running")
                )
            if request.inputs is None:  # a backward leaving its inputs to its kept forward (see .protocol)
                request.inputs = self.shared.kept.inputs(request.forward_id)
                if request.inputs is None:
                    error = NotKept(f"Stage {self.stage} no longer keeps the forward of this backward")
                    return error_reply(request.request_id, UNAVAILABLE, error)
            self.schemas.check(request.inputs.tensors)
        except BadRequest as e:
            logger.debug(f"Stage {self.stage}: rejected a request: {e}")
            return error_reply(request.request_id, REQUEST, e)
        self.catch_up(request.epoch)
        with self.shared.grads_lock:  # handle runs in several threads
            self.requests_served += 1
        batcher = self.batcher
        if batcher is None:
            return self._serve_one(request)
        try:
            return batcher.submit(request)
        except Exception as e:  # the server stopped meanwhile (or a bug in the batcher)
            return error_reply(request.request_id, UNAVAILABLE, e)

    def _serve_one(self, request: StageRequest) -> StageReply:
        """Serve one request on its own; never raises."""
        try:
            inputs = _inputs(request)
            if request.kind == "forward":
                keep = request.forward_id if request.forward_id == request.request_id else None
                outputs = self._forward(inputs, keep, request.training, request.seed, request.buffers)
                kept = keep is not None and self.shared.kept.inputs(keep) is not None
            else:
                assert request.grad_outputs is not None
                outputs = self._backward(
                    inputs,
                    request.grad_outputs,
                    request.request_id,
                    request.commit_by,
                    self.shared.kept.take(request.forward_id),
                    request.training,
                    request.seed,
                )
                kept = False
            self.schemas.learn(inputs.tensors)
            return StageReply(request.request_id, outputs=outputs, kept=kept)
        except BadRequest as e:
            logger.debug(f"Stage {self.stage}: rejected a request: {e}")
            return error_reply(request.request_id, REQUEST, e)
        except TooLate as e:
            logger.debug(f"Stage {self.stage}: {e}")
            return error_reply(request.request_id, UNAVAILABLE, e)
        except _NonFinite as e:
            logger.warning(f"Stage {self.stage}: {e}")
            return error_reply(request.request_id, COMPUTE, e)
        except _ComputeError as e:
            logger.warning(f"Stage {self.stage}: the stage raised {type(e.error).__name__}: {e.error}")
            return error_reply(request.request_id, COMPUTE, e.error)
        except (
            Exception
        ) as e:  # out of memory, or a bug here: not the caller's fault, another peer may do better
            logger.warning(f"Stage {self.stage}: could not serve a {request.kind} call: {e!r}")
            return error_reply(request.request_id, UNAVAILABLE, e)

    def _serve_group(self, requests: list[StageRequest]) -> list[StageReply]:
        """Serve mergeable requests (one group at a time, see :class:`.batching.RequestBatcher`): merged into one computation, or one by one
        if the merged one fails in any way (each request then gets its own answer or error); never raises."""
        if len(requests) > 1 and any(_kept_backward(r, self.shared.kept) for r in requests):
            # a backward whose forward is kept here runs alone (no recomputation to share); the rest may merge
            kept = {id(r) for r in requests if _kept_backward(r, self.shared.kept)}
            rest = [r for r in requests if id(r) not in kept]
            by_request = {id(r): self._serve_one(r) for r in requests if id(r) in kept}
            if rest:
                by_request.update(zip((id(r) for r in rest), self._serve_group(rest), strict=True))
            return [by_request[id(r)] for r in requests]
        if len(requests) > 1:
            try:
                replies = self._serve_merged(requests)
                if replies is not None:
                    return replies
            except Exception as e:
                logger.debug(
                    f"Stage {self.stage}: {len(requests)} merged {requests[0].kind} calls failed ({e!r}); "
                    "serving them one by one"
                )
        return [self._serve_one(request) for request in requests]

    def _merge_key(self, request: StageRequest) -> tuple[Any, int]:
        """The request's merge key (see :func:`.batching.merge_key`); ``None`` (served alone) for a training forward
        whose activations would be kept for its backward, once this stage's forward of its size takes longer
        than ``MERGE_FORWARD_MAX_S`` (measured): a merged forward keeps nothing, and recomputing it for each
        backward costs more than merging spares. Alone, its reply also leaves as soon as it is computed rather
        than with a whole group's, so the next stage is not kept waiting.

        Nor does a training call (train-mode forward, or backward) of a trainer-driven stage that trains, so that a
        run is reproducible, as DDP's is: which calls happen to wait together changes from run to run, and a
        merged call's results do not have the bits of the calls run alone (one backward of merged calls sums
        their parameter gradients inside its matrix products; a matrix product of a few rows takes another
        kernel than one of many). Served one by one, each backward's gradients are added to the step's sum,
        whose value does not depend on their order (see ``SharedState.add_pending``)."""
        key, rows = merge_key(request, distinct_seeds=self.draws_rng)
        if self.driven and self.shared.training and getattr(request, "training", True):
            return None, rows
        per_row = self._forward_s_per_row
        if (
            key is not None
            and request.kind == "forward"
            and per_row is not None
            and per_row * rows > MERGE_FORWARD_MAX_S
            and request.forward_id == request.request_id  # a training forward whose backward will come
            and self.settings.keep_activations > 0
            and self.shared.trained
        ):
            return None, rows
        return key, rows

    def _serve_merged(self, requests: list[StageRequest]) -> list[StageReply] | None:
        """Serve ``requests`` (same kind, mode and structure, see :func:`.batching.merge_key`) with one
        computation, under the first request's seed; ``None`` if the results cannot be split or committed per
        request, or if a train-mode run drew random numbers (each call's dropout masks must come from its own
        seed): the caller serves them one by one. Raises whatever the merged computation raised."""
        rows = [_inputs(request).batch_size() for request in requests]
        inputs = concat_payloads([_inputs(request) for request in requests])
        training, seed = requests[0].training, requests[0].seed
        if requests[0].kind == "forward":
            merged = self._forward(inputs, None, training, seed, requests[0].buffers)
            if training and self.draws_rng:
                return None
            outputs = split_payload(merged, rows)
            if outputs is None:
                return None
            replies = [
                StageReply(r.request_id, outputs=out) for r, out in zip(requests, outputs, strict=True)
            ]
        else:
            grad_outputs = concat_payloads([request.grad_outputs for request in requests])  # type: ignore[misc]
            grad_inputs, param_grads = self._backward_compute(inputs, grad_outputs, None, training, seed)
            if training and self.draws_rng:
                return None
            pieces = split_payload(Payload.flatten(grad_inputs), rows)
            if pieces is None or not self._commit_merged(requests, param_grads, rows):
                return None
            replies = []
            for request, piece in zip(requests, pieces, strict=True):
                try:
                    check_finite(piece.tensors, f"stage {self.stage} input gradient", _NonFinite)
                    replies.append(StageReply(request.request_id, outputs=piece))
                except _NonFinite as e:
                    logger.warning(f"Stage {self.stage}: {e}")
                    replies.append(error_reply(request.request_id, COMPUTE, e))
        for request, reply in zip(requests, replies, strict=True):
            if reply.error is None:
                self.schemas.learn(_inputs(request).tensors)
        return replies

    def _forward(
        self,
        inputs: Payload,
        keep_id: int | None = None,
        training: bool = True,
        seed: int | None = None,
        buffers: bool = True,
    ) -> Payload:
        """The stage's outputs for ``inputs`` in mode ``training`` under ``seed``; with ``keep_id`` (and
        ``keep_activations`` > 0) the forward runs with autograd and its graph is kept under that id for the
        backward. ``buffers`` ``False``: a train-mode forward leaves the stage's buffers as they were (a call of a
        trainer that does not own them, see :class:`~lightning_swarm.swarm.wire.protocol.StageRequest`)."""
        leaves = leaves_of(inputs, self.device)
        keep = (
            keep_id is not None
            and self.settings.keep_activations > 0
            and self.shared.refresh_pending_since is None
        )
        keep = keep and (bool(self.shared.trained) or any(leaf.requires_grad for leaf in leaves))
        args, kwargs = inputs.rebuild_call(leaves)
        with self._foreground(), self.shared.lock, torch.enable_grad() if keep else torch.no_grad():
            start, began = time.perf_counter(), time.monotonic()
            with buffers_kept(self.module, training and not buffers):
                outputs = self._run_module(args, kwargs, training, seed)
            version, spent = self.shared.param_version, time.perf_counter() - start
            self.compute_log.append(("forward", began, time.monotonic()))
        rows = inputs.batch_size()
        if rows > 0:
            old = self._forward_s_per_row
            now = spent / rows
            self._forward_s_per_row = now if old is None else (1 - _FORWARD_EMA) * old + _FORWARD_EMA * now
        payload = _outputs_payload(outputs)
        check_outputs(payload.tensors, leaves, f"stage {self.stage} output", _NonFinite)
        if not keep:
            return payload
        assert keep_id is not None
        self.shared.kept.keep(
            keep_id, Kept(inputs.skeleton, leaves, payload.tensors, version, spent, time.monotonic())
        )
        return Payload(payload.skeleton, [t.detach() for t in payload.tensors])

    def _backward(
        self,
        inputs: Payload,
        grad_outputs: Payload,
        request_id: int | None = None,
        commit_by: float | None = None,
        kept: Kept | None = None,
        training: bool = True,
        seed: int | None = None,
    ) -> Payload:
        weights = self.shared.weights
        if kept is not None and weights is not None and not weights.unsplittable:  # see .weight_grads
            reply = self._backward_split(inputs, grad_outputs, request_id, commit_by, kept)
            if reply is not None:
                return reply
        try:
            grad_inputs, param_grads = self._backward_compute(inputs, grad_outputs, kept, training, seed)
        finally:
            if kept is not None:
                self._done_with_kept()
        self._commit(param_grads, inputs.batch_size(), request_id, commit_by)
        check_finite(list(grad_inputs), f"stage {self.stage} input gradient", _NonFinite)
        return Payload.flatten(grad_inputs)

    def _backward_compute(
        self,
        inputs: Payload,
        grad_outputs: Payload,
        kept: Kept | None = None,
        training: bool = True,
        seed: int | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor | None]]:
        """The gradients of the inputs that require grad and of the trained parameters (nothing committed), from
        the ``kept`` forward of these inputs if it is still valid, else by recomputing the forward in mode
        ``training`` under ``seed`` (the forward's dropout masks; buffers such as batch normalisation's running
        statistics are left as they were: the forward updated them already)."""
        grads = grad_outputs.rebuild()
        batch_size = inputs.batch_size()
        trained = self.shared.trained
        with self._foreground(), self.shared.lock:
            start, began = time.perf_counter(), time.monotonic()
            results: list[torch.Tensor | None] | None = None
            if kept is not None and kept.matches(inputs, self.shared.param_version):
                try:
                    results = self._grads_of(kept.leaves, kept.outputs, grads, trained)
                    leaves, spent = kept.leaves, kept.forward_s
                    self.kept_hits += 1
                except _ComputeError as e:  # e.g. an input changed in place since: recompute below
                    logger.debug(f"Stage {self.stage}: kept forward unusable ({e.error!r}); recomputing it")
                    results = None
            if results is None:
                leaves, spent = leaves_of(inputs, self.device), 0.0
                args, kwargs = inputs.rebuild_call(leaves)
                with buffers_kept(self.module, training), torch.enable_grad():
                    outputs = _outputs_payload(self._run_module(args, kwargs, training, seed)).tensors
                    results = self._grads_of(leaves, outputs, grads, trained)
            self.throughput.record(batch_size, spent + time.perf_counter() - start)
            self.compute_log.append(("backward", began, time.monotonic()))
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grad_inputs = _filled(wanted, results)
        return grad_inputs, exclusive(results[len(wanted) :], grad_inputs)

    def _backward_split(
        self,
        inputs: Payload,
        grad_outputs: Payload,
        request_id: int | None,
        commit_by: float | None,
        kept: Kept,
    ) -> Payload | None:
        """A backward from the ``kept`` forward that replies with the input gradients and leaves the parameter
        gradients to :attr:`_weights` (see :mod:`.weight_grads`); ``None`` (nothing done) where that does not apply."""
        weights = self.shared.weights
        assert weights is not None
        grads = grad_outputs.rebuild()
        with weights.foreground(), self.shared.lock:
            if not kept.matches(inputs, self.shared.param_version):
                return None
            start, began = time.perf_counter(), time.monotonic()
            try:
                outputs, output_grads = _roots(kept.outputs, grads)
                wanted = [leaf for leaf in kept.leaves if leaf.requires_grad]
                split = split_backward(outputs, output_grads, wanted, self.shared.trained)
            except BadRequest:
                raise
            except Exception as e:  # the whole backward (below) says what is wrong, or recomputes
                logger.debug(f"Stage {self.stage}: backward not split ({e!r})")
                return None
            if split is None:  # this stage's graph cannot be split (tied weights, say): not tried again
                logger.debug(f"Stage {self.stage}: backwards run whole (see weight_grads.split_backward)")
                weights.unsplittable = True
                return None
            results, work = split
            work.spent = kept.forward_s + time.perf_counter() - start
            self.compute_log.append(("backward", began, time.monotonic()))
        grad_inputs = _filled(wanted, results)
        rows = inputs.batch_size()
        try:
            claimed = self._claim(rows, request_id, commit_by)
        except BaseException:
            self._done_with_kept()
            raise
        if claimed:
            weights.defer(work, lambda w: self._add_weights(w, rows, grad_inputs))
        else:
            self._done_with_kept()
        check_finite(list(grad_inputs), f"stage {self.stage} input gradient", _NonFinite)
        return Payload.flatten(grad_inputs)

    def _add_weights(self, work: WeightWork, rows: int, grad_inputs: tuple[torch.Tensor, ...]) -> None:
        """A deferred backward's parameter gradients are computed: into the step's sum (see :meth:`_backward_split`)."""
        self._done_with_kept()
        if work.error is not None:
            return  # the step is refused (Stepper._take_pending)
        self.throughput.record(rows, work.spent)
        grads = exclusive(work.grads, grad_inputs)  # none of the reply's tensors is added into
        with self.shared.grads_lock:
            self.shared.add_pending(grads, rows)
        self.shared.wake.set()

    def _done_with_kept(self) -> None:
        self.shared.kept.done()
        if self.shared.refresh_pending_since is not None:
            self.shared.wake.set()  # new parameters may have been waiting for this backward

    def _claim(self, rows: int, request_id: int | None, commit_by: float | None) -> bool:
        """Count a trainer-driven backward whose parameter gradients come later (:meth:`_add_weights`), at most
        once per request id and before ``commit_by`` (else :class:`TooLate`); returns whether they are wanted."""
        _check_deadline(request_id, commit_by)
        with self.shared.grads_lock:
            return self._claim_locked(rows, request_id)

    def _claim_locked(self, rows: int, request_id: int | None) -> bool:
        """:meth:`_claim` for a caller that holds ``_grads_lock`` and has checked the deadline."""
        if request_id is not None and not self.applied.add(request_id):
            logger.debug(f"Stage {self.stage}: backward request {request_id} was already applied here")
            return False
        self.samples_processed += rows
        return self.shared.training  # else: not training this stage

    def _foreground(self) -> contextlib.AbstractContextManager:
        """Around a forward's or backward's use of the stage: deferred parameter gradients wait (.weight_grads)."""
        return contextlib.nullcontext() if self.shared.weights is None else self.shared.weights.foreground()

    @staticmethod
    def _grads_of(
        leaves: list[torch.Tensor], outputs: list[torch.Tensor], grads: Any, trained: list[nn.Parameter]
    ) -> list[torch.Tensor | None]:
        """Gradients of the leaves that require grad, then of ``trained``, given the outputs' gradients."""
        roots, root_grads = _roots(outputs, grads)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        if not roots or not (wanted or trained):
            return [None] * (len(wanted) + len(trained))
        try:  # gradients are returned, not accumulated in .grad: the stepper owns the optimizer's
            return list(torch.autograd.grad(roots, [*wanted, *trained], root_grads, allow_unused=True))
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            raise _ComputeError(e) from e

    def _commit(
        self,
        grads: list[torch.Tensor | None],
        batch_size: int,
        request_id: int | None,
        commit_by: float | None,
    ) -> None:
        """Add a backward's parameter gradients to the pending ones, at most once per request id, and only
        before the caller's ``commit_by`` deadline (raises :class:`TooLate` after it)."""
        _check_deadline(request_id, commit_by)
        # trainer-driven: the step's sum is checked instead (Stepper._unscale, a pass per step) and a step that is not
        # finite is skipped, as GradScaler skips it in one process; swarm-driven: this backward is dropped
        finite = self.driven or all_finite(grads)
        with self.shared.grads_lock:
            if not self._claim_locked(batch_size, request_id):
                return
            if not finite:  # never let them reach the optimizer (nor, through averaging, the other peers)
                self.dropped_contributions += 1
                logger.warning(
                    f"Stage {self.stage}: backward request {request_id} produced NaN or infinite parameter "
                    f"gradients; its contribution was dropped ({self.dropped_contributions} so far)"
                )
                return
            self.shared.add_pending(grads, batch_size)
        self.shared.wake.set()

    def _commit_merged(
        self, requests: list[StageRequest], grads: list[torch.Tensor | None], rows: list[int]
    ) -> bool:
        """Commit the summed parameter gradients of merged backwards, counting every request's samples, if each
        request may be applied now: before its ``commit_by``, its id not applied yet (nor twice in the group)
        and the gradients finite. Otherwise commits nothing and returns False: the requests are then served one
        by one, which applies each exactly as :meth:`_commit` does."""
        now = time.time()
        if any(r.commit_by is not None and now > r.commit_by for r in requests):
            return False
        if not self.driven and not all_finite(grads):  # see _commit
            return False
        ids = [r.request_id for r in requests if r.request_id is not None]
        with self.shared.grads_lock:
            if len(set(ids)) != len(ids) or any(self.applied.known(i) for i in ids):
                return False
            for request_id in ids:
                self.applied.add(request_id)
            self.samples_processed += sum(rows)
            if not self.shared.training:
                return True
            self.shared.add_pending(grads, sum(rows), len(requests))
        self.shared.wake.set()
        return True

    def _run_module(self, args: tuple, kwargs: dict, training: bool = True, seed: int | None = None) -> Any:
        """Run the stage module in mode ``training`` with its random generators seeded with ``seed`` (under the
        parameters lock)."""
        self.computations += 1
        self._set_mode(training)
        try:
            autocast = self.settings.autocast
            # the trainer's mixed precision (Lightning's "bf16-mixed"/"16-mixed"): the same autocast here
            precision = (
                torch.autocast(self.device.type, dtype=getattr(torch, autocast), cache_enabled=False)
                if autocast is not None
                else contextlib.nullcontext()
            )
            with seeded_rng(seed, self.device) as drew, precision:
                outputs = self.module(*args, **kwargs)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            raise _ComputeError(e) from e
        if training and drew[0]:
            self.draws_rng = True  # from now on its train-mode calls are not merged (see batching)
        return outputs

    def _set_mode(self, training: bool) -> None:
        """Eval: every submodule in eval mode; train: the modes the module was built with (a block the user
        froze in eval stays so), as Lightning restores them after validation. Under the parameters lock."""
        if training == self._training:
            return
        if training:
            for module, mode in self._built_modes:
                module.training = mode
        else:
            self.module.eval()
        self._training = training


class _ComputeError(Exception):
    """The stage's own code raised ``error`` (wrapped so that it is told apart from the server's errors)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _NonFinite(FloatingPointError):
    """The stage's own computation produced NaN or infinite outputs or input gradients from finite inputs."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message}; the stage diverged (lower the learning rate, or check the model in fp32)"
        )


def _inputs(request: StageRequest) -> Payload:
    """A request's inputs (a backward sent without them has its kept forward's by now, see ``handle``)."""
    assert request.inputs is not None
    return request.inputs


def error_reply(request_id: int, category: str, error: BaseException) -> StageReply:
    """The reply to request ``request_id`` that failed with ``error`` (see :mod:`..wire.errors` for categories)."""
    return StageReply(request_id, error=ErrorReply.from_exception(error, category))


def _kept_backward(request: StageRequest, kept: KeptForwards) -> bool:
    """Whether ``request`` is a backward whose forward is kept here."""
    return request.kind == "backward" and kept.holds(request.forward_id)


def _roots(outputs: list[torch.Tensor], grads: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs a backward starts from (those with a gradient that require grad) and their gradients, in the
    outputs' dtype and device (:class:`BadRequest` for gradients that do not fit the outputs)."""
    check_grad_outputs(grads, outputs)
    pairs = [
        (out, grad.to(device=out.device, dtype=out.dtype))
        for out, grad in zip(outputs, grads, strict=True)
        if grad is not None and out.requires_grad
    ]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _filled(wanted: list[torch.Tensor], results: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """The input gradients sent back: zeros for an input that got none."""
    return tuple(g if g is not None else torch.zeros_like(t) for t, g in zip(wanted, results, strict=False))


def _check_deadline(request_id: int | None, commit_by: float | None) -> None:
    if commit_by is not None and time.time() > commit_by:
        raise TooLate(
            f"backward request {request_id} finished {time.time() - commit_by:.1f} s after its commit deadline; "
            "its gradients were not applied (the caller retries it elsewhere)"
        )


def _outputs_payload(outputs: Any) -> Payload:
    """The stage's outputs as a payload; outputs that cannot travel are the stage's own error."""
    try:
        payload = Payload.flatten(outputs)
        for t in payload.tensors:
            check_encodable(t)
    except CodecError as e:
        raise _ComputeError(e) from e
    return payload
