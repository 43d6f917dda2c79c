"""Every override of hivemind's private averaging API, in one file (hivemind is pinned to 1.1.12): a part
reducer that tolerates bad senders, guarded all-reduce runners, averagers that start from any thread and whose
waits end when their process dies, a progress tracker that finishes its tasks at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind's servicer reads typing's AsyncIterator only)

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, anext, as_aiter, enter_asynchronously
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.swarm.footprint import before_fork, untouched_shared
from lightning_swarm.swarm.wire.codec import all_finite

logger = logging.getLogger(__name__)

# averaging: a part whose norm exceeds this many times the median of the group's parts is dropped (groups of 3+)
OUTLIER_NORM_RATIO = 100.0

_DRAIN_S = 2.0  # seconds a progress tracker's leftover tasks get to finish once cancelled

# group ids of rounds among peers a trainer named (no matchmaking)
_NAMED_GROUP_TAG = b"lightning-swarm/named:"
_NAMED_GROUP_POLL_S = 0.002  # how often a part that came before its named round began looks for the round


HELPER_POLL_S = 0.1  # how often a wait on a helper process checks that the helper still lives


class HelperDied(RuntimeError):
    """A hivemind helper process this peer waited on (an averager's) has died: nothing will ever answer."""


def helper_alive(process: Any) -> bool:
    """Whether a helper process lives; one this process did not start counts as alive (it cannot tell)."""
    try:
        return bool(process.is_alive())
    except (AssertionError, ValueError):
        return True


def wait_on_helper(future: Any, helper: Any, what: str, timeout: float | None = None) -> Any:
    """``future.result()`` for a future that the process ``helper`` resolves: at most ``timeout`` seconds (``None``:
    as long as the helper lives, then ``TimeoutError``), and :class:`HelperDied` within ``HELPER_POLL_S`` of the
    helper's death, instead of forever."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=max(0.0, min(HELPER_POLL_S, deadline - time.monotonic())))
        except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError
            if not helper_alive(helper):
                raise HelperDied(f"{what}: its helper process (pid {helper.pid}) died") from None
            if time.monotonic() >= deadline:
                raise


class NamedGroupFailed(Exception):
    """A round among named peers did not complete (a peer did not join in time, or the all-reduce failed)."""


def named_group_id(uid: str, step_id: int, attempt: int) -> bytes:
    """The id of the all-reduce round of step ``step_id``'s attempt ``attempt`` of stage ``uid``: every peer the
    trainer commanded derives the same id, with nothing to agree on beforehand."""
    digest = hashlib.blake2b(f"{uid}|{step_id}|{attempt}".encode(), digest_size=16).digest()
    return _NAMED_GROUP_TAG + digest


class _LoadProbe(DecentralizedAverager):
    """The state download of :class:`StageStateAverager`, under hivemind's ``TrainingStateAverager`` in its MRO:
    records whether the last download got a state that is loaded (hivemind's only logs it), and refuses an
    incomplete one.

    A donor's stream can end early without an error (fewer tensors than the stage has parameters and extra
    tensors). hivemind's ``TrainingStateAverager`` then logs an ERROR and loads nothing, while the download still
    looked like a success here. Such a state is now dropped here with one warning, so that :attr:`loaded` is
    ``False`` and the joining peer tries again. So is a state from a donor whose epoch is behind this peer's, which
    hivemind refuses with a warning of its own."""

    loaded = False
    # set by TrainingStateAverager, above this class in StageStateAverager's MRO
    optimizer: torch.optim.Optimizer
    extra_tensors: tuple[torch.Tensor, ...]
    local_epoch: int

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        result = super().load_state_from_peers(wait=wait, timeout=timeout)
        loaded = result is not None
        if wait and loaded:
            result, loaded = self._usable(result)
        self.loaded = loaded
        return result

    def _usable(self, result: Any) -> tuple[Any, bool]:
        """``(result, whether hivemind will load it)``; ``result`` is ``None`` for a state that is incomplete."""
        metadata, tensors = result
        expected = sum(len(group["params"]) for group in self.optimizer.param_groups) + len(
            self.extra_tensors
        )
        if len(tensors) < expected:
            logger.warning(
                f"A state downloaded from a peer was incomplete ({len(tensors)} tensors, fewer than the "
                f"{expected} parameters and extra tensors of this stage); not loaded"
            )
            return None, False
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        return result, isinstance(epoch, int) and epoch >= self.local_epoch


class _RobustPartReducer(TensorPartReducer):
    """hivemind's reducer of the slice of the averaged tensors this peer aggregates, guarded against hostile
    senders: a part that is not finite, or sent with a weight that is not a finite non-negative number, is
    dropped; so is, in groups of three senders or more, a part whose norm exceeds :data:`OUTLIER_NORM_RATIO`
    times the median norm of the parts of that slice. The slice's average is that of the remaining parts (every
    sender, the dropped ones included, gets it back). Dropped parts are logged as warnings."""

    def __init__(self, part_shapes: Any, num_senders: int, sender_names: list[Any]) -> None:
        self._stash: list[tuple[int, torch.Tensor, float]] = []
        self.sender_names = sender_names
        self.dropped = 0
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self._stash = []
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        # hivemind's TensorPartReducer.accumulate_part, keeping the parts until the slice is complete
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            if tensor_part.shape != self.part_shapes[part_index]:
                raise AllreduceException(f"sender {sender_index} sent a part of the wrong shape")
            self._stash.append((sender_index, tensor_part, weight))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from == self.num_current_senders:
            self.accumulator, self.denominator = self._robust_sum()
        super().check_current_part_finished()

    def _robust_sum(self) -> tuple[torch.Tensor, float]:
        kept, reasons = [], {}
        for sender, part, weight in self._stash:
            if not (math.isfinite(weight) and weight >= 0):
                reasons[sender] = f"weight {weight}"
            elif not all_finite(part):
                reasons[sender] = "NaN or infinite values"
            else:
                kept.append((sender, part, weight))
        weighted = [part for _, part, weight in kept if weight > 0]  # weight 0: a peer without samples
        if len(weighted) >= 3:
            norms = [float(part.float().norm()) for _, part, _ in kept]
            median = sorted(float(part.float().norm()) for part in weighted)[len(weighted) // 2]
            if median > 0:
                for (sender, _, _), norm in zip(kept, norms, strict=True):
                    if norm > OUTLIER_NORM_RATIO * median:
                        reasons[sender] = f"norm {norm:.3g}, {norm / median:.0f} times the group's median"
                kept = [item for item in kept if item[0] not in reasons]
        for sender, why in reasons.items():
            self.dropped += 1
            logger.warning(
                f"Averaging: dropped the part of peer {self.sender_names[sender]} ({why}); the others are "
                f"averaged without it"
            )
        accumulator = torch.zeros(self.part_shapes[self.current_part_index])
        denominator = 0.0
        for _, part, weight in kept:
            accumulator.add_(part, alpha=weight)
            denominator += weight
        self._stash = []
        if denominator <= 0:  # nothing usable: a zero average (hivemind would divide by zero)
            return accumulator, 1.0
        return accumulator, denominator


class _GuardedAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce with a :class:`_RobustPartReducer`, and the averaged slices that other peers send
    back checked: a reducer that returns NaN or infinite values counts as failed, so this peer keeps its own
    values for that slice (hivemind's handling of a reducer that drops out)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        plain = self.tensor_part_reducer  # type: ignore[has-type]
        self.tensor_part_reducer = _RobustPartReducer(
            plain.part_shapes, plain.num_senders, list(self.sender_peer_ids)
        )
        plain.num_senders = 0  # finalized unused: no "received 0% of input tensors" warning
        plain.finalize()
        container = self.tensor_part_container
        register = container.register_processed_part
        peer_ids = self.ordered_peer_ids

        def register_checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            if not all_finite(part):
                logger.warning(
                    f"Averaging: peer {peer_ids[peer_index]} returned a non-finite average; keeping the local "
                    f"values of its slice"
                )
                raise AllreduceException(f"peer {peer_ids[peer_index]} returned a non-finite average")
            register(peer_index, part_index, part)

        container.register_processed_part = register_checked


class _GuardedAveraging:
    """Runs a :class:`DecentralizedAverager`'s all-reduce rounds with :class:`_GuardedAllReduceRunner`."""

    async def _run_allreduce_inplace_(
        self, tensors: Any, group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        # hivemind's DecentralizedAverager._run_allreduce_inplace_ with another runner class
        group_id = group_info.group_id if group_id is None else group_id
        runner = _GuardedAllReduceRunner(
            p2p=self._p2p,  # type: ignore[attr-defined]
            servicer_type=type(self),
            prefix=self.prefix,  # type: ignore[attr-defined]
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        running = self._running_groups  # type: ignore[attr-defined]
        assert group_id in running, f"Group id {group_id!r} was not registered in _register_allreduce_group"
        running[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:  # type: ignore[attr-defined]
                # hivemind pairs the two with azip, whose asyncio.gather leaves an orphaned future when the runner's
                # wait is cancelled mid-round (a peer died): asyncio then prints "Future exception was never
                # retrieved" and a traceback. The tensors are at hand: take the next one for each update.
                local = iter(tensors)
                async for update in runner:
                    tensor = next(local, None)
                    if tensor is None:
                        break
                    tensor.add_(update, alpha=self._averaging_alpha)  # type: ignore[attr-defined]
                    self.last_updated = get_dht_time()
                    self._state_updated.set()  # type: ignore[attr-defined]
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
        finally:
            # the runner keeps a failed round's exception in a future of its own that nothing awaits (a round cut
            # off by averaging_timeout: CancelledError): retrieved here, or asyncio prints it with a traceback
            outcome = runner._future
            if outcome.done() and not outcome.cancelled():
                outcome.exception()


class _StartsInAnyThread:
    """hivemind's averagers set SIGINT to be ignored in the *calling* process before they fork, so that the forked
    averager inherits it; only the main thread may do that, and a Ctrl-C that comes while the averager starts
    (a second or more) would be lost by the peer. These start from any thread without touching this process's
    SIGINT (a peer that migrates starts its new stage's averagers in a background thread); the forked averager
    ignores SIGINT itself, first thing (it is already in a process group of its own, see ``lifetime``). Free heap
    pages are handed back first (see ``footprint.release_free_memory``)."""

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        # hivemind has just moved the averaged tensors to shared memory (their private copies freed, still resident
        # in the heap): the forked averager would inherit those pages and keep them once this process reuses them
        before_fork()
        self.start()  # type: ignore[attr-defined]
        if await_ready:
            self.wait_until_ready(timeout)  # type: ignore[attr-defined]

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the peer stops its averagers itself, in order
        super().run()  # type: ignore[misc]


class WatchedAverager(DecentralizedAverager):
    """hivemind's averager whose host-process waits on its helper process end when that process dies: a wait for
    the averaged tensors' lock, for a round to start or end, or for a state download raises :class:`HelperDied`
    within ``HELPER_POLL_S`` of the death (hivemind would wait forever, e.g. on the lock a killed averager held
    mid-round). Nothing is sent to a dead helper (the host's own end of the pipe would read it), and shutting a dead
    one down does nothing (hivemind would log an error). Listed after hivemind's averager classes in a subclass's
    bases, so that it sits just above ``DecentralizedAverager``."""

    def _check_helper(self, what: str) -> None:
        if not helper_alive(self):
            raise HelperDied(f"{type(self).__name__} {what}: its helper process (pid {self.pid}) died")

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[Any]:
        if os.getpid() != self._parent_pid:  # in the averager's own process: hivemind's
            with super().get_tensors() as tensors:
                yield tensors
            return
        lock = self.lock_averaged_tensors
        while not lock.acquire(timeout=HELPER_POLL_S):
            self._check_helper("averaged tensors")
        try:
            yield self._averaged_tensors
        finally:
            lock.release()

    def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
    ) -> Any:
        # hivemind's DecentralizedAverager.step, with its two waits on the helper process bounded
        self._check_helper("step")
        if scheduled_time is None:
            scheduled_time = get_dht_time() + self.matchmaking_kwargs["min_matchmaking_time"]
        if weight is None:
            weight = float(self.mode != AveragingMode.AUX)
        deadline = get_dht_time() + timeout if timeout is not None else float("inf")
        assert isinstance(weight, int | float) and weight >= 0, (
            f"Expected a positive int/float, got {type(weight)}"
        )
        assert not (wait and require_trigger), (
            "Non-asynchronous step cannot wait for trigger (use wait=False)"
        )
        assert scheduled_time < deadline, "Scheduled start time does not fit within timeout"
        user_data_for_gather = self.serializer.dumps(gather)
        data_for_gather = self.serializer.dumps([self.bandwidth, self.mode.value, user_data_for_gather])
        step = StepControl(
            scheduled_time=scheduled_time,
            deadline=deadline,
            allow_retries=allow_retries,
            weight=weight,
            data_for_gather=data_for_gather,
        )
        future_for_init: MPFuture = MPFuture()
        self._outer_pipe.send(("_step", [], dict(step=step, future_for_init=future_for_init)))
        step.attach(*wait_on_helper(future_for_init, self, "an averaging round's start"))
        if not require_trigger:
            step.allow_allreduce()
        return wait_on_helper(step, self, "an averaging round") if wait else step

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        self._check_helper("state download")
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future)))
        return wait_on_helper(future, self, "a state download", timeout) if wait else future

    @property
    def allow_state_sharing(self) -> bool:
        return bool(self._allow_state_sharing.value)

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if helper_alive(self):
            DecentralizedAverager.allow_state_sharing.fset(self, value)
        else:
            self._allow_state_sharing.value = value

    @property
    def state_sharing_priority(self) -> float:
        return float(self._state_sharing_priority.value)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        if helper_alive(self):
            DecentralizedAverager.state_sharing_priority.fset(self, value)
        else:
            self._state_sharing_priority.value = value

    def shutdown(self) -> None:
        if helper_alive(self):
            super().shutdown()


class StageStateAverager(
    _StartsInAnyThread, _GuardedAveraging, TrainingStateAverager, _LoadProbe, WatchedAverager
):
    """hivemind's state averager of a stage, telling whether a joiner's download succeeded, and serving downloads
    of a consistent state: hivemind increments the epoch before the optimizer step and reads the parameters
    without the optimizer's lock, so a download during a step could get the old parameters under the new epoch.
    Trainer-driven steps hold :attr:`state_lock` over the whole step; downloads take it too (hivemind serves a
    download from the host process, where the stage steps)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.state_lock = threading.RLock()  # before hivemind's constructor, which may start the averager
        super().__init__(*args, **kwargs)

    def get_current_state(self) -> Any:
        with self.state_lock:
            return super().get_current_state()


class NamedGroups:
    """All-reduce rounds among peers that a trainer names (:meth:`sum_in_named_group`), instead of a group found
    by hivemind's matchmaking, which waits for ``matchmaking_time`` every round: a trainer that commands a
    stage's peers to step knows who they are, and gives them the round's id and the order of its members."""

    def sum_in_named_group(self, group_id: bytes, peer_ids: list[PeerID], timeout: float) -> int:
        """Average the averaged tensors with exactly ``peer_ids`` (this peer among them, every weight 1) in one
        all-reduce round; returns the group's size. Raises :class:`NamedGroupFailed` if the round did not
        complete within ``timeout`` seconds (the tensors then hold this peer's values or a partial average)."""
        if not helper_alive(self):
            raise HelperDied(f"{type(self).__name__}: its helper process (pid {self.pid}) died")  # type: ignore[attr-defined]
        future: MPFuture = MPFuture()
        self._outer_pipe.send(  # type: ignore[attr-defined]
            (
                "_named_group_round",
                [],
                dict(group_id=group_id, peer_ids=tuple(peer_ids), timeout=timeout, future=future),
            )
        )
        return wait_on_helper(future, self, "a named averaging round", timeout + 5.0)

    async def _named_group_round(
        self, group_id: bytes, peer_ids: tuple[PeerID, ...], timeout: float, future: MPFuture
    ) -> None:
        try:
            mode = self.mode  # type: ignore[attr-defined]
            if self.peer_id not in peer_ids or mode != AveragingMode.NODE:  # type: ignore[attr-defined]
                raise NamedGroupFailed(f"this peer ({mode.name}) is not a full member of the named group")
            kwargs = dict(self.allreduce_kwargs)  # type: ignore[attr-defined]
            size = self.total_size  # type: ignore[attr-defined]
            fractions = load_balance_peers(size, [1.0] * len(peer_ids), kwargs.pop("min_vector_size"))
            group = GroupInfo(group_id, peer_ids, tuple(b"" for _ in peer_ids))

            async def run() -> None:
                async with enter_asynchronously(self.get_tensors()) as tensors:  # type: ignore[attr-defined]
                    await self._run_allreduce_inplace_(  # type: ignore[attr-defined]
                        tensors,
                        group,
                        peer_fractions=fractions,
                        tensor_infos=self.tensor_infos,  # type: ignore[attr-defined]
                        weight=1.0,
                        **kwargs,
                    )

            with self._register_allreduce_group(group):  # type: ignore[attr-defined]
                await asyncio.wait_for(run(), timeout)
            future.set_result(len(peer_ids))
        except Exception as e:
            if not future.done():
                future.set_exception(NamedGroupFailed(f"{type(e).__name__}: {e}"))
        except BaseException:
            if not future.done():
                future.set_exception(NamedGroupFailed("the round was cancelled"))
            raise

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # a peer of a named round may begin before this one does (nothing synchronises their starts): its first
        # part waits here for this peer's round to be registered, at most the all-reduce's timeout
        request = await anext(stream)
        running = self._running_groups  # type: ignore[attr-defined]
        if request.group_id.startswith(_NAMED_GROUP_TAG) and request.group_id not in running:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + (self._allreduce_timeout or 30.0)  # type: ignore[attr-defined]
            while request.group_id not in running and loop.time() < deadline:
                await asyncio.sleep(_NAMED_GROUP_POLL_S)
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):  # type: ignore[misc]
            yield message


class StageGradientAverager(
    _StartsInAnyThread, NamedGroups, _GuardedAveraging, GradientAverager, WatchedAverager
):
    """hivemind's gradient averager, startable from any thread, whose waits end if its process dies (see
    :class:`WatchedAverager`), guarded against hostile contributions (see :class:`_RobustPartReducer`), and counting each backward the server sums into one optimizer step.

    hivemind takes the gradient of each ``step(batch_size)`` as one batch's mean gradient, scales it by its size
    relative to the round's first batch and divides the round's sum by the number of steps. The stage server
    hands it the *sum* of the backwards it served since its last step (one, or several that arrived together, or
    a merged backward): taken as one batch, they were counted ``n`` times over (and the others scaled down by the
    first step's size). Here the sum is added as it is and every backward counts once (:attr:`backwards`, set by
    the server before each step), so a round averages the backwards' gradients whatever their grouping, as
    accumulating gradients over batches does in one process.
    """

    backwards = 1

    def __init__(
        self,
        parameters,
        *args: Any,
        averaged_grads=(),
        extra_like: tuple[torch.Tensor, ...] = (),
        **kwargs: Any,
    ) -> None:
        # its buffers are written only in a round with the stage's other peers (see Stepper._sum_with_peers):
        # shared memory whose pages are allocated when first written, rather than hivemind's dense zeros.
        # ``extra_like``: tensors summed in the same rounds after the gradients (float32 slots shaped as these:
        # the stage's running statistics and their weight, see Stepper.sync_buffers); hivemind's own uses of the
        # averaged gradients pair them with the parameters and stop at the last parameter
        parameters = tuple(parameters)
        if not averaged_grads:
            averaged_grads = tuple(untouched_shared(p) for p in parameters)
        extras = tuple(untouched_shared(torch.empty(t.shape, dtype=torch.float32)) for t in extra_like)
        super().__init__(parameters, *args, averaged_grads=(*averaged_grads, *extras), **kwargs)

    def accumulate_grads_(self, batch_size: int) -> None:
        if self._anchor_batch_size is None:  # type: ignore[has-type]
            self._anchor_batch_size = batch_size
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += self.backwards
        for grad_buf, grad_acc in zip(self._grads_from_parameters(), self._grad_accumulators(), strict=True):
            grad_acc.add_(grad_buf.to(grad_acc.device))


class SwarmProgressTracker(ProgressTracker):
    """hivemind's progress tracker, whose thread finishes its event loop's tasks before it ends.

    hivemind 1.1.12 stops the tracker's loop as soon as its two coroutines return, leaving the DHT lookup or store
    that was in flight at shutdown pending (the store cancelled, the lookup not); when the loop is garbage-collected,
    asyncio logs "Task was destroyed but it is pending!" at ERROR for each, often at interpreter exit. Here the
    leftovers are cancelled and run to their end (at most ``_DRAIN_S``), then the loop is closed.
    """

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
        finally:
            try:
                leftovers = asyncio.all_tasks(loop)
                for task in leftovers:
                    task.cancel()
                if leftovers:
                    loop.run_until_complete(asyncio.wait(leftovers, timeout=_DRAIN_S))
                for task in leftovers:  # retrieved, or asyncio would log "exception was never retrieved"
                    if task.done() and not task.cancelled():
                        task.exception()
                loop.close()
            finally:
                self.shutdown_complete.set()


def no_partner(error: BaseException) -> bool:
    """Whether an averaging round failed only because no partner showed up (expected now and then), as opposed
    to a broken round (shape mismatch, a reducer's exception, a peer that sent garbage)."""
    return "could not find a group" in str(error)
