"""Several trainers step as the ranks of DDP do: one global step per global batch, the same gradient everywhere.

With ``stage_steps="trainer"`` (the default) and several trainers, each trainer computes its own batch (its stage
calls' backwards add up in the stages' pending gradients), then hands the gradients of its *own* parameters (the
modules outside the pipeline: embeddings, heads) to the step's **leader**, the live trainer with the smallest peer
id. The leader waits until every live trainer has handed in its part (at most ``trainer_timeout`` seconds: a
trainer that dies or lags is left out of that step, logged and counted), sums the parts in peer-id order, divides
by the number of trainers that took part, and replies to each with that average: every trainer gets the same
bits, so their parameters stay identical, as DDP's ranks' do (checked: every ``HASH_EVERY`` steps each part carries
a hash of the trainer's parameters, and a difference is an error on every trainer).

Each optimizer step of a trainer is one global step: with several optimizers (manual optimization) every
``optimizer.step()`` is its own exchange, in the same order on every trainer (the leader checks that the parts name
the same optimizer). The stages' ids of a step's commands are derived from the run, the global step's index and the
optimizer (:func:`stage_step_id`), never from a trainer's own counter, so every trainer names the same stage step
whoever leads it; so are the ids of the ``optimizer.zero_grad()`` calls mirrored to the stages between two steps
(:meth:`TrainerSync.zero_step_id`), which the stages apply once however many trainers send them.

The step's result also carries the leader's *buffers* (those of the modules outside the pipeline: a trainer-side
BatchNorm's running statistics), which the other trainers copy, as DDP broadcasts rank 0's buffers before each
forward (``broadcast_buffers``); and only the leader's train-mode stage calls update the stages' buffers
(:meth:`TrainerSync.leads_next`; the request's ``buffers`` flag, see :mod:`~lightning_swarm.swarm.wire.protocol`),
so that every buffer follows one trainer's batches, one update per forward, as rank 0's do in DDP.

Then every trainer runs its optimizer step on the same gradient; the leader alone commands the stages (see
:mod:`.stepping`): their summed gradients are scaled by 1/K like the trainers' (DDP's average over K ranks), its
squared norm for clipping and its replies are *published* under the step's id, and the other trainers read them
from the leader (:meth:`TrainerSync.await_value`) instead of commanding the stages themselves, so a stage sees one
step command per global step. A trainer that cannot reach the leader takes the next trainer as leader once the
leader is gone: its presence record says it no longer trains (it died, or finished), or it has not answered for as
long as a step may take. A leader that is only slow to answer (a loaded machine) is waited for: passing over it
would make two trainers each lead their own steps, and train two models. At the start of the run, before this
trainer's first step, a leader that never answered it (its training has not started yet) is passed over after
``trainer_timeout``. The stage commands are idempotent per step id, so a step commanded twice is applied once.

A trainer's part that reaches the leader after its step was taken (``late``) is dropped, and the trainer applies
that step's average instead: it stays in step with the others, and its parameters identical to theirs.

Wire (every wait is a request of a few seconds, asked again while the answer is pending, so that no stream is held
open for a whole step): ``rpc_contribute``, a stream of messages (the gradients' parts, see :mod:`.transport`, then a
msgpack header), answered at once; ``rpc_result``: ``[step, name, wait_s]`` -> the step's result (the averaged
gradients' parts, then its header) or ``pending``; ``rpc_await``: ``[step_id, key, wait_s]`` -> ``[found, value]``. Headers and values are validated; a malformed message is refused, never crashes a
trainer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator as AsyncIteratorABC
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind detects stream handlers by typing.AsyncIterator)

import msgpack
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.footprint import add_widened
from lightning_swarm.swarm.loop import replicate_p2p, run_coroutine
from lightning_swarm.swarm.wire.codec import encode_parts
from lightning_swarm.swarm.wire.transport import MessageReceiver, messages

__all__ = ["HASH_EVERY", "StepResult", "TrainerSync", "TrainersDiverged", "params_hash", "stage_step_id"]

logger = logging.getLogger(__name__)

HASH_EVERY = 10  # every this many steps each trainer's part carries a hash of its parameters
_HISTORY = 8  # results (and published values) a trainer keeps for late or retrying trainers
_MAX_PART_BYTES = 8 << 30  # a part's gradients, decoded: refused beyond this
_POLL_S = 0.02
_UNSEEN = "(a trainer of the local swarm not seen yet)"
_RESULT_WAIT_S = 2.0  # how long one request for a step's result waits at the leader
_BROKEN_LIMIT = 3  # requests in a row that fail before the leader counts as gone


class _NotLeader(ConnectionError):
    """The trainer a part was sent to does not lead the step; it named the one that does."""


class TrainersDiverged(RuntimeError):
    """The trainers' own parameters differ: they no longer train one model."""


@dataclass
class StepResult:
    """One global step of the trainers, as the leader decided it.

    Args:
        step: the global step's index (counted from 0 by every trainer, one per optimizer step).
        step_id: the stages' id of this step's commands (see :mod:`.stepping`): :func:`stage_step_id` of the step
            and its optimizer, the same on every trainer.
        leader: the leader's name (base58 peer id).
        trainers: how many trainers' parts the average holds (the stages' gradients are divided by it too).
        missing: the trainers the leader waited for that did not hand in their part in time.
        grads: the averaged gradients, aligned with the parameters the parts listed (``None``: no trainer had one).
        nonfinite: backwards whose loss-scaled gradients overflowed before reaching a stage, on all trainers.
        late: this trainer's own part came after the step was taken: ``grads`` is the others' average.
        names: the trainers whose parts the average holds.
        buffers: the leader's own buffers after its batch of the step (the modules outside the pipeline), which
            the other trainers take (DDP's ``broadcast_buffers``); empty if it handed in none.
    """

    step: int
    step_id: int
    leader: str
    trainers: int
    missing: list[str] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    nonfinite: int = 0
    late: bool = False
    names: list[str] = field(default_factory=list)
    buffers: list[torch.Tensor | None] = field(default_factory=list)


def params_hash(params: list[torch.Tensor]) -> str:
    """A short hash of parameters' values (to check that trainers hold the same ones)."""
    h = hashlib.blake2b(digest_size=16)
    for p in params:
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def stage_step_id(run_id: str, step: int, optimizer: int, kind: str = "step", count: int = 0) -> int:
    """The stages' id of global step ``step`` of optimizer ``optimizer`` (``kind="step"``: its ``"norm"`` and
    ``"apply"`` commands), or of its ``count``-th mirrored ``zero_grad`` before that step (``kind="zero"``): the
    same on every trainer of the run, and different for every step, optimizer and kind (62 bits of a hash)."""
    h = hashlib.blake2b(f"{run_id}\0{kind}\0{step}\0{optimizer}\0{count}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big") >> 2


class _Part:
    """One trainer's part of a step: its header and gradients (and, for the leader's own part, which is not sent,
    its buffers)."""

    def __init__(
        self,
        header: dict[str, Any],
        grads: list[torch.Tensor | None],
        buffers: list[torch.Tensor] | None = None,
    ) -> None:
        self.header, self.grads, self.buffers = header, grads, buffers or []


class _Round:
    """A step the leader collects parts for."""

    def __init__(self) -> None:
        self.parts: dict[str, _Part] = {}
        self.result: StepResult | None = None
        self.error: str | None = None
        self.late_errors: dict[str, str] = {}  # trainer -> why its late part shows it diverged


def _encode_grads(
    grads: list[torch.Tensor | None],
) -> tuple[list[runtime_pb2.Tensor], list[list[int] | None]]:
    parts: list[runtime_pb2.Tensor] = []
    shapes: list[list[int] | None] = []
    for g in grads:
        if g is None:
            shapes.append(None)
            continue
        shapes.append(list(g.shape))
        parts.extend(encode_parts(g.detach().float().contiguous().cpu(), "none"))
    return parts, shapes


def _decode_grads(tensors: list[torch.Tensor], shapes: Any) -> list[torch.Tensor | None]:
    if not isinstance(shapes, list):
        raise ValueError("trainer step: shapes must be a list")
    out: list[torch.Tensor | None] = []
    it = iter(tensors)
    for shape in shapes:
        if shape is None:
            out.append(None)
            continue
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError("trainer step: a shape must be a list of non-negative integers")
        t = next(it, None)
        if t is None or t.dtype != torch.float32 or t.numel() != math.prod(shape):
            raise ValueError("trainer step: the gradients do not match their shapes")
        out.append(t.reshape(shape))
    if next(it, None) is not None:
        raise ValueError("trainer step: more gradients than shapes")
    return out


def _check_header(header: Any) -> dict[str, Any]:
    if not isinstance(header, dict):
        raise ValueError("trainer step: the header must be a map")
    for key in ("step", "optimizer", "nonfinite"):
        if type(header.get(key)) is not int or header[key] < 0:
            raise ValueError(f"trainer step: {key} must be a non-negative integer")
    if not isinstance(header.get("name"), str) or not 0 < len(header["name"]) <= 128:
        raise ValueError("trainer step: name must be a peer id")
    if header.get("hash") is not None and not isinstance(header["hash"], str):
        raise ValueError("trainer step: hash must be a string")
    return header


class TrainerSync(ServicerBase):
    """One trainer's side of the trainers' global steps (see the module's docstring).

    Args:
        dht: this peer's running DHT (its p2p daemon serves the handlers).
        run_id: the swarm's run id (the handlers' namespace).
        name: this trainer's base58 peer id.
        live_trainers: the names of the trainers now training (from the peers' presence records), or ``None``
            when unknown; the leader waits for these.
        expected: how many trainers the run starts with, where known (a local swarm): the first step waits for
            that many parts (up to ``timeout``) even before their presence records are read.
        timeout: seconds the leader waits for the parts of a step after its own (``trainer_timeout``).
        should_stop: polled while waiting; True ends the wait (the peer is stopping).
    """

    def __init__(
        self,
        dht: Any,
        run_id: str,
        name: str,
        live_trainers: Callable[[], set[str] | None],
        expected: int | None = None,
        timeout: float = 60.0,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.dht, self.run_id, self.name = dht, run_id, name
        self.live_trainers, self.expected, self.timeout = live_trainers, expected, timeout
        self.should_stop = should_stop
        self.namespace = f"{run_id}.trainers"
        self.p2p: P2P | None = None
        self.step = 0  # this trainer's next global step
        self.missed_steps = 0  # trainer-steps the steps this trainer led went without (counted, logged)
        self.late_steps = 0  # steps this trainer's own part came too late for
        self.joined_at = 0  # the global step this trainer joined at (0: it started with the run)
        self._cond = threading.Condition()
        self._rounds: OrderedDict[int, _Round] = OrderedDict()
        self._published: OrderedDict[tuple[int, str], Any] = OrderedDict()
        self._failed: dict[str, float] = {}  # leaders this trainer could not reach, until when it skips them
        self._known: set[str] = set()  # trainers that took part in a step this trainer saw
        self._joiners: dict[int, set[str]] = {}  # step -> trainers that join at it (they loaded its state)
        self._state_wanted: set[str] = set()  # trainers waiting for this one's state (to join late)
        self._state: tuple[int, bytes] | None = None  # the last state offered: (step, blob)
        self._initial: bytes | None = None  # the state before any step (see start)
        self.finished = False  # this trainer's training ended: it leads no more steps
        self._hinted: set[str] = set()  # leaders other trainers named (a trainer this one had not seen yet)
        self._answered: set[str] = set()  # trainers that answered this one's requests at least once
        self._last: StepResult | None = None
        self._zeros: dict[int, int] = {}  # optimizer -> zero_grad calls mirrored since the last step

    # ------------------------------------------------------------------ life
    def start(self, initial: bytes | None = None) -> None:
        """Serve the other trainers (parts, results, published values, state for joiners). ``initial``: this
        trainer's state before any step, which trainers starting with a larger name adopt (as DDP broadcasts rank
        0's parameters when it wraps the model)."""
        self._initial = initial
        if self.p2p is None:
            self.p2p = run_coroutine(self._start_p2p(), timeout=60)

    async def _start_p2p(self) -> P2P:
        p2p = await replicate_p2p(self.dht)
        await self.add_p2p_handlers(p2p, namespace=self.namespace)
        return p2p

    def shutdown(self) -> None:
        p2p, self.p2p = self.p2p, None
        if p2p is None:
            return
        try:
            run_coroutine(p2p.shutdown(), timeout=10)
        except Exception as e:
            logger.debug(f"Trainer sync: p2p shutdown failed: {e!r}")

    # ------------------------------------------------------------------ a step
    def exchange(
        self,
        grads: list[torch.Tensor | None],
        optimizer: int = 0,
        nonfinite: int = 0,
        params: list[torch.Tensor] | None = None,
        buffers: list[torch.Tensor] | None = None,
    ) -> StepResult:
        """Hand in this trainer's part of the current global step, a step of its optimizer ``optimizer``
        (``configure_optimizers`` order), and return the step's result (blocking); ``params`` (this trainer's own
        parameters) are hashed every ``HASH_EVERY`` steps; ``buffers`` (its own buffers) go into the result if this
        trainer leads the step (they stay here otherwise). Raises :class:`TrainersDiverged` if the trainers'
        parameters differ, or if they step different optimizers."""
        step = self.step
        header: dict[str, Any] = {
            "step": step,
            "optimizer": int(optimizer),
            "nonfinite": int(nonfinite),
            "name": self.name,
        }
        if params is not None and step % HASH_EVERY == 0:
            header["hash"] = params_hash(params)
        part = _Part(header, [None if g is None else g.detach().float().cpu() for g in grads], buffers)
        since: dict[str, float] = {}  # the leaders this part was handed to, since when
        while True:
            leader = self._leader()
            if leader == self.name:
                result = self._lead(step, part)
                break
            since.setdefault(leader, time.monotonic())
            try:
                result = self._send(leader, part)
                break
            except TrainersDiverged:
                raise
            except _NotLeader:
                time.sleep(0.05)  # the trainer named its leader, which this one now knows
                continue
            except Exception as e:
                if self.should_stop():
                    raise _stopping() from None
                unstarted = (  # the run starts, and the leader never answered: its training has not started
                    self._last is None
                    and self.joined_at == 0
                    and leader not in self._answered
                    and time.monotonic() - since[leader] >= self.timeout
                )
                if not unstarted and not self._gone(leader, since[leader]):
                    # it still trains, and is slow to answer (a loaded machine): passing over it would make this
                    # trainer lead its own steps beside it, and the two would train two models. At the start of
                    # the run, a leader that never answered (it sleeps in a callback before its training starts,
                    # say) is passed over after trainer_timeout: it leads no one yet, and joins with the state
                    logger.debug(f"Trainer step {step}: the leader {leader[-8:]} did not answer yet ({e!r})")
                    time.sleep(0.25)
                    continue
                why = "has not started training" if unstarted else "no longer trains"
                logger.warning(
                    f"Trainer step {step}: the leader {leader[-8:]} did not answer ({type(e).__name__}: {e}) and "
                    f"{why}; trying the next trainer"
                )
                self._failed[leader] = time.monotonic() + 3 * self.timeout
        self.step = step + 1
        self._last = result
        self._zeros = {}
        self._known.update(result.names)
        for (
            name
        ) in result.names:  # it took part: it answers (every trainer of the step picks the same leader next)
            self._failed.pop(name, None)
        if result.late:
            self.late_steps += 1
            logger.warning(
                f"Trainer step {step}: this trainer's part came after the step was taken without it; it applies "
                "the others' average (its own batch is not in that step)"
            )
        return result

    def _gone(self, leader: str, since: float) -> bool:
        """Whether a leader that does not answer this trainer (tried since ``since``) is gone: its presence record
        says it no longer trains (it died, or its training ended), or it has not answered for ``3 * timeout + 30``
        seconds (as long as a step's result may take) although it looks alive. A leader whose record is unreadable
        counts as alive. (A leader that never answered this trainer is passed over sooner: see :meth:`exchange`.)"""
        live = self.live_trainers()
        return (live is not None and leader not in live) or time.monotonic() - since > 3 * self.timeout + 30.0

    def zero_step_id(self, optimizer: int) -> int:
        """The stages' id of this trainer's next mirrored ``zero_grad`` of optimizer ``optimizer`` (see
        :func:`stage_step_id`): the n-th such call since the last global step has the same id on every trainer,
        so the stages drop that optimizer's gradients once, at the first trainer's call."""
        count = self._zeros.get(optimizer, 0)
        self._zeros[optimizer] = count + 1
        return stage_step_id(self.run_id, self.step, optimizer, "zero", count)

    def publish(self, step_id: int, key: str, value: Any) -> None:
        """Make ``value`` of step ``step_id`` available to the other trainers (see :meth:`await_value`)."""
        with self._cond:
            self._published[(step_id, key)] = value
            while len(self._published) > 4 * _HISTORY:
                self._published.popitem(last=False)
            self._cond.notify_all()

    def await_value(self, leader: str, step_id: int, key: str, timeout: float) -> Any:
        """The value the leader published for ``(step_id, key)``, waiting up to ``timeout`` seconds (in requests of
        at most ``_RESULT_WAIT_S``); raises ``TimeoutError`` or a connection error if the leader did not publish it
        (the caller then does the work itself)."""
        if leader == self.name:
            found, value = self._wait_published(step_id, key, timeout)
            if not found:
                raise TimeoutError(f"no value {key!r} for step {step_id}")
            return value
        stub = self.get_stub(self._p2p(), PeerID.from_base58(leader), namespace=self.namespace)
        deadline = time.monotonic() + timeout
        ask = runtime_pb2.ExpertInfo(serialized_info=msgpack.packb([step_id, key, _RESULT_WAIT_S]))
        while True:
            reply = self._asked(lambda: stub.rpc_await(ask, timeout=_RESULT_WAIT_S + 30.0))
            found, value = msgpack.unpackb(reply.serialized_info, raw=False, strict_map_key=False)
            if found:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the leader published no value {key!r} for step {step_id} in {timeout:.0f} s"
                )

    # ------------------------------------------------------------------ leader
    def _leader(self, wait: bool = True) -> str:
        """The trainer with the smallest name among those that lead the next step: at the start of a run, the live
        trainers (with ``wait``, a local swarm's expected trainers are waited for, at most ``timeout``; without, the
        ones seen so far); then the trainers of the last step this one saw (and leaders others named), whether or
        not their presence record is read, so that two trainers never both lead a step because one lost sight of
        the other for a moment. The leaders this trainer passed over (gone, or never started: see :meth:`exchange`)
        are left out. Every trainer of a step computes the same next leader from the step's result."""
        now = time.monotonic()
        if self._last is None and self.joined_at == 0 and self.step == 0:  # the trainers start together
            deadline = now + self.timeout
            while True:
                live = self.live_trainers() or set()
                if not wait or self.expected is None or len(live | {self.name}) >= self.expected:
                    break
                if time.monotonic() >= deadline or self.should_stop():
                    break
                time.sleep(0.1)
            candidates = live | self._hinted | {self.name}
        else:
            candidates = set(self._last.names if self._last is not None else ()) | self._hinted
        names = {n for n in candidates if self._failed.get(n, 0.0) < now}
        return min(names) if names else self.name

    def leads_next(self) -> bool:
        """Whether this trainer leads its next global step, as far as it knows without waiting (:meth:`_leader`).
        The leader's train-mode stage calls update the stages' buffers."""
        return self._leader(wait=False) == self.name

    def _round(self, step: int) -> _Round:
        """The round of ``step`` (under ``_cond``)."""
        found = self._rounds.get(step)
        if found is None:
            found = self._rounds[step] = _Round()
            while len(self._rounds) > _HISTORY:
                self._rounds.popitem(last=False)
        return found

    def _lead(self, step: int, own: _Part) -> StepResult:
        """Collect the parts of ``step`` (this trainer's ``own`` and the others'), then average them."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            rnd = self._round(step)
            if rnd.result is not None:  # taken without this trainer (it lagged, and led before)
                return _late(rnd.result)
            rnd.parts[self.name] = own
        # the trainers of the last step this trainer saw, and any it waits for: those that do not hand in their
        # part (they died: their presence record expires; or they lag past the deadline) are counted missing
        waited = set(self._last.names) if self._last is not None else set()
        while True:
            live = self.live_trainers()
            with self._cond:
                waiting = self._waiting_for(rnd, live, step)
                waited |= {n for n in waiting if n != _UNSEEN}
                if not waiting or time.monotonic() >= deadline:
                    break
            if self.should_stop():
                raise _stopping()
            with self._cond:
                self._cond.wait(_POLL_S)
        with self._cond:
            missing = sorted(waited - set(rnd.parts))
            rnd.result, rnd.error = self._average(step, rnd, missing)
            for part in rnd.parts.values():
                part.grads, part.buffers = [], []  # averaged: only the names are needed from now on
            self._cond.notify_all()
        if rnd.error is not None:
            raise TrainersDiverged(rnd.error)
        if missing:
            self.missed_steps += len(missing)
            logger.warning(
                f"Global step {step} went on without {len(missing)} trainer(s) that did not hand in their part "
                f"(gone from the swarm, or later than trainer_timeout={self.timeout:.0f} s): "
                f"{', '.join(m[-8:] for m in missing)}"
            )
        assert rnd.result is not None
        return rnd.result

    def _waiting_for(self, rnd: _Round, live: set[str] | None, step: int) -> set[str]:
        """The trainers ``rnd`` still waits for (under ``_cond``): the live ones that took part in a step before,
        those that joined at this step (:meth:`offer_state`) and, at the first step of a local swarm, as many as
        it starts with. A trainer that is live but has not taken part yet is starting (or loading the state of a
        late join): it is not waited for until it joins."""
        joining = self._joiners.get(step, set())
        names = (set(live or ()) & (self._known | joining) | joining) - set(rnd.parts)
        names = {n for n in names if self._failed.get(n, 0.0) < time.monotonic()}
        if self.expected is not None and len(rnd.parts) < self.expected and step == 0:
            names.add(_UNSEEN)  # its presence record may not be read yet
        return names

    def _average(self, step: int, rnd: _Round, missing: list[str]) -> tuple[StepResult, str | None]:
        names = sorted(rnd.parts)
        parts = [rnd.parts[n] for n in names]
        self._known.update(names)
        hashes = {p.header.get("hash") for p in parts if p.header.get("hash") is not None}
        optimizer = int(rnd.parts[self.name].header["optimizer"])
        error = None
        stepped = sorted({int(p.header["optimizer"]) for p in parts})
        if len(stepped) > 1:
            error = (
                f"The trainers stepped different optimizers at global step {step} (indices {stepped}): every trainer "
                "must call its optimizers' step() in the same order (manual optimization: the same calls on every "
                "trainer, not ones that depend on its own batch)."
            )
        if len(hashes) > 1:
            error = _diverged(step, f"hashes of {len(hashes)} kinds among {len(parts)} trainers")
        lengths = {len(p.grads) for p in parts}
        if len(lengths) > 1:
            error = (
                f"The trainers' optimizers hold different numbers of parameters at global step {step} "
                f"({sorted(lengths)}): every trainer must run the same LightningModule and configure_optimizers."
            )
        grads: list[torch.Tensor | None] = []
        if error is None:
            k = float(len(parts))
            for i in range(lengths.pop()):
                present = [g for p in parts if (g := p.grads[i]) is not None]
                if not present:
                    grads.append(None)
                    continue
                if len({tuple(g.shape) for g in present}) > 1:
                    error = f"The trainers' gradients of parameter {i} differ in shape at global step {step}."
                    break
                # in float64, where the sum of float32 (or half) values is exact but for terms more than about
                # 2**28 apart: the average does not depend on the order of the parts (peer-id order, which differs
                # from run to run), so a run with three or more trainers is reproducible, as DDP's is
                total = torch.zeros_like(present[0], dtype=torch.float64)
                for g in present:
                    add_widened(total, g)
                grads.append(total.div_(k).to(present[0].dtype))
        result = StepResult(
            step=step,
            step_id=stage_step_id(self.run_id, step, optimizer),
            leader=self.name,
            trainers=len(parts),
            missing=missing,
            grads=grads,
            nonfinite=sum(int(p.header["nonfinite"]) for p in parts),
            names=names,
            buffers=[b.detach().float().cpu().clone() for b in rnd.parts[self.name].buffers],
        )
        return result, error

    # ------------------------------------------------------------------ follower
    def _send(self, leader: str, part: _Part) -> StepResult:
        """Hand ``part`` to ``leader`` (``rpc_contribute``, answered at once), then ask for the step's result
        (``rpc_result``, each call waiting at most ``_RESULT_WAIT_S``) until the leader has it. A stream that
        breaks is asked again (a few times in a row at most: then the leader counts as gone); a leader that no
        longer knows the part (it restarted) gets it again."""
        wire, shapes = _encode_grads(part.grads)
        header = msgpack.packb({**part.header, "shapes": shapes}, use_bin_type=True)
        step, deadline = int(part.header["step"]), time.monotonic() + 3 * self.timeout + 30.0
        stub = self.get_stub(self._p2p(), PeerID.from_base58(leader), namespace=self.namespace)

        async def contribute() -> tuple[bytes, list[torch.Tensor]]:
            async def requests() -> AsyncIteratorABC[runtime_pb2.ExpertRequest]:
                for message in messages(runtime_pb2.ExpertRequest, wire, header):
                    yield message

            return await _first_reply(await stub.rpc_contribute(requests()))

        async def result() -> tuple[bytes, list[torch.Tensor]]:
            ask = msgpack.packb([step, self.name, _RESULT_WAIT_S])
            return await _first_reply(await stub.rpc_result(runtime_pb2.ExpertInfo(serialized_info=ask)))

        def retried(make: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
            data, tensors = self._asked(make)
            reply = msgpack.unpackb(data, raw=False, strict_map_key=False)
            if not isinstance(reply, dict):
                raise ValueError("malformed trainer step reply")
            if reply.get("error"):
                if reply.get("diverged"):
                    raise TrainersDiverged(str(reply["error"]))
                hint = reply.get("leader")
                if isinstance(hint, str) and 0 < len(hint) <= 128 and hint != self.name:
                    self._hinted.add(hint)  # the trainer asked knows a leader this one had not seen
                    raise _NotLeader(hint)
                raise ConnectionError(str(reply["error"]))
            return reply, tensors

        retried(contribute)
        self._answered.add(leader)
        while True:
            reply, tensors = retried(result)
            if reply.get("unknown"):
                retried(contribute)  # the leader does not know the part (it restarted): again
                continue
            if reply.get("pending"):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the leader had no result of step {step} in {3 * self.timeout + 30:.0f} s"
                    )
                continue
            return _parse_result(reply, tensors, leader)

    def _p2p(self) -> P2P:
        if self.p2p is None:
            raise ConnectionError("this trainer's step exchange is shut down")
        return self.p2p

    def _asked(self, make: Callable[[], Any], keep_trying: Callable[[], bool] = lambda: False) -> Any:
        """The result of the request ``make()`` (a coroutine) to another trainer, asked again after a broken
        stream: up to ``_BROKEN_LIMIT`` times in a row, or for as long as ``keep_trying()`` says (a trainer that is
        still starting); a peer that is stopping stops asking."""
        broken = 0
        while True:
            try:
                return run_coroutine(
                    asyncio.wait_for(make(), _RESULT_WAIT_S + 30.0),
                    timeout=_RESULT_WAIT_S + 35.0,
                    stop=self.should_stop,
                )
            except Exception as e:
                if self.should_stop():
                    raise _stopping() from None
                broken += 1
                if broken >= _BROKEN_LIMIT and not keep_trying():
                    raise
                logger.debug(f"Asking trainer again after {type(e).__name__}: {e}")
                time.sleep(0.2)

    # ------------------------------------------------------------------ handlers
    async def rpc_contribute(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Another trainer's part of a step, answered at once: taken, or refused (malformed; not the leader)."""
        receiver = MessageReceiver(max_bytes=_MAX_PART_BYTES)
        done = False
        async for message in requests:
            if receiver.feed(message):
                done = True
                break
        try:
            if not done:
                raise ValueError("trainer step: the stream ended before the header")
            data, tensors = receiver.result()
            header = _check_header(msgpack.unpackb(data, raw=False, strict_map_key=False))
            part = _Part(header, _decode_grads(tensors, header.get("shapes")))
        except Exception as e:  # a malformed part: refused, never a crash
            yield _reply({"error": f"malformed trainer step part: {type(e).__name__}: {e}"})
            return
        loop = asyncio.get_running_loop()
        taken = await loop.run_in_executor(None, self._take_part, part)
        yield _reply({"ok": True} if taken else self._not_leader(int(header["step"])))

    async def rpc_result(
        self, request: runtime_pb2.ExpertInfo, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[step, name, wait_s]`` -> the step's result once this trainer (its leader) has it (the averaged
        gradients, then the header), or ``{"pending": true}`` after ``wait_s``; ``{"unknown": true}`` if it has
        no part of ``name`` for that step."""
        try:
            step, name, wait = msgpack.unpackb(request.serialized_info, raw=False)
            if type(step) is not int or not isinstance(name, str) or not isinstance(wait, (int, float)):
                raise ValueError
            wait = min(max(float(wait), 0.0), 60.0)
        except Exception:
            yield _reply({"error": "malformed trainer step result request"})
            return
        loop = asyncio.get_running_loop()
        state, result, error = await loop.run_in_executor(None, self._wait_result, step, name, wait)
        if error is not None:
            yield _reply({"error": error, "diverged": True})
            return
        if result is None:
            yield _reply(self._not_leader(step) if state == "gone" else {state: True})
            return
        wire, shapes = _encode_grads([*result.grads, *result.buffers])
        body = {
            "step": result.step,
            "step_id": result.step_id,
            "trainers": result.trainers,
            "missing": result.missing,
            "nonfinite": result.nonfinite,
            "shapes": shapes,
            "late": result.late,
            "names": result.names,
            "buffers": len(result.buffers),
        }
        for message in messages(runtime_pb2.ExpertResponse, wire, msgpack.packb(body, use_bin_type=True)):
            yield message

    async def rpc_state(
        self, request: runtime_pb2.ExpertInfo, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``[name, wait_s]`` -> this trainer's state at its next step boundary (see :meth:`offer_state`), as parts
        of one uint8 tensor then ``{"step": s}``; ``{"fresh": true}`` if no step was taken yet (start together);
        ``{"pending": true}`` after ``wait_s``."""
        try:
            name, wait = msgpack.unpackb(request.serialized_info, raw=False)
            if not isinstance(name, str) or not 0 < len(name) <= 128 or not isinstance(wait, (int, float)):
                raise ValueError
            wait = min(max(float(wait), 0.0), 60.0)
        except Exception:
            yield _reply({"error": "malformed trainer state request"})
            return
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, self._wait_state, name, wait)
        if found is None or isinstance(found, str):
            yield _reply({found or "pending": True})
            return
        step, blob = found
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        wire = list(encode_parts(data, "none"))
        for message in messages(runtime_pb2.ExpertResponse, wire, msgpack.packb({"step": step})):
            yield message

    def _wait_state(self, name: str, wait: float) -> tuple[int, bytes] | str | None:
        deadline = time.monotonic() + wait
        with self._cond:
            if self.step == 0 and self._last is None:  # the run starts: this trainer's initial state
                return (0, self._initial) if self._initial is not None else "fresh"
            if self._state is not None and name in self._joiners.get(self._state[0], set()):
                return self._state
            self._state_wanted.add(name)
            while time.monotonic() < deadline:
                if self._state is not None and name in self._joiners.get(self._state[0], set()):
                    return self._state
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            return None

    def offer_state(self, make: Callable[[], bytes]) -> None:
        """At a step boundary (this trainer's optimizer step done, its next batch not begun): if other trainers
        asked for this trainer's state to join (``rpc_state``), hand them ``make()`` (its own parameters,
        optimizer and schedule, the next step's index) and wait for their parts at the next step."""
        with self._cond:
            wanted, self._state_wanted = self._state_wanted, set()
        if not wanted:
            return
        blob = make()
        with self._cond:
            self._state = (self.step, blob)
            self._joiners.setdefault(self.step, set()).update(wanted)
            for old in [s for s in self._joiners if s < self.step - _HISTORY]:
                del self._joiners[old]
            self._cond.notify_all()
        logger.info(f"Global step {self.step}: {len(wanted)} trainer(s) join with this trainer's state")

    def fetch_state(self) -> tuple[int, bytes] | None:
        """Join a run in progress: ask the other live trainers, smallest name first, for their state at their next
        step boundary; returns ``(step index, blob)`` from the first that has taken a step, or ``None`` when none
        has (the trainers start together). Afterwards this trainer's next global step is that step, and the trainer
        that gave its state is its first leader (or names the leader)."""
        live = (self.live_trainers() or set()) - {self.name}
        for other in sorted(live):
            try:
                found = self._fetch_state_from(other, starting=other < self.name)
            except Exception as e:
                if self.should_stop():
                    raise _stopping() from None
                logger.debug(f"Trainer {other[-8:]} did not hand over its state: {type(e).__name__}: {e}")
                continue
            self._answered.add(other)
            if found is None:
                continue
            step, _ = found
            if step == 0 and other > self.name:
                continue  # the run starts: trainers adopt the initial state of the one with the smallest name
            self.step = self.joined_at = step
            self._hinted.add(other)
            if step > 0:
                logger.info(f"This trainer joins the run at global step {step} with the current parameters")
            return found
        return None

    def _fetch_state_from(self, other: str, starting: bool = False) -> tuple[int, bytes] | None:
        """``other``'s state (see :meth:`fetch_state`); ``starting``: the run may be starting, and ``other`` not
        answering yet (it starts too): asked again for up to ``timeout`` while it is live."""
        stub = self.get_stub(self._p2p(), PeerID.from_base58(other), namespace=self.namespace)
        deadline, started = time.monotonic() + 3 * self.timeout + 30.0, time.monotonic()
        ask = runtime_pb2.ExpertInfo(serialized_info=msgpack.packb([self.name, _RESULT_WAIT_S]))

        async def state() -> tuple[bytes, list[torch.Tensor]]:
            return await _first_reply(await stub.rpc_state(ask))

        def starting_up() -> bool:
            return (
                starting
                and time.monotonic() - started < self.timeout
                and other in (self.live_trainers() or ())
            )

        while True:
            data, tensors = self._asked(state, keep_trying=starting_up)
            reply = msgpack.unpackb(data, raw=False)
            if not isinstance(reply, dict) or reply.get("error"):
                raise ConnectionError(f"trainer {other[-8:]} refused this trainer's join: {reply}")
            if reply.get("fresh"):
                return None
            if reply.get("pending"):
                if time.monotonic() > deadline:
                    raise TimeoutError("the trainer did not hand over its state to join the run")
                continue
            step = reply.get("step")
            if type(step) is not int or step < 0 or len(tensors) != 1 or tensors[0].dtype != torch.uint8:
                raise ValueError("malformed trainer state")
            return step, tensors[0].numpy().tobytes()

    def _not_leader(self, step: int) -> dict[str, Any]:
        leader = None if self.finished else self._leader()
        return {
            "error": f"trainer {self.name[-8:]} does not lead step {step}",
            "leader": leader if leader != self.name else None,
        }

    def _take_part(self, part: _Part) -> bool:
        """Add ``part`` to its round (a thread of the handler); False if this trainer does not lead that step."""
        step = int(part.header["step"])
        with self._cond:
            rnd = self._rounds.get(step)
            if rnd is not None and rnd.result is not None:
                _check_late(rnd, part)
                return True  # taken already: the part is late (rpc_result says so)
            if step < self.step - _HISTORY or self.finished:
                return False
        if self._leader() != self.name:  # another trainer leads (this one sends its own parts there)
            return False
        with self._cond:
            rnd = self._round(step)
            if rnd.result is None:
                rnd.parts[part.header["name"]] = part
                self._cond.notify_all()
            return True

    def _wait_result(self, step: int, name: str, wait: float) -> tuple[str, StepResult | None, str | None]:
        """The result of ``step`` for trainer ``name``, waiting up to ``wait`` seconds: ``("ok", result, error)``,
        or ``("pending" | "unknown" | "gone", None, None)``."""
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                rnd = self._rounds.get(step)
                if rnd is not None and rnd.result is not None:
                    late = name not in rnd.parts
                    error = rnd.late_errors.get(name) or rnd.error
                    return "ok", (_late(rnd.result) if late else rnd.result), error
                if rnd is None or name not in rnd.parts:
                    return ("gone" if step < self.step - _HISTORY else "unknown"), None, None
                if self.step > step and self._leader_of_last() != self.name:
                    return "gone", None, None  # this trainer took that step under another leader
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "pending", None, None
                self._cond.wait(min(remaining, 0.1))

    def _leader_of_last(self) -> str | None:
        return self._last.leader if self._last is not None else None

    async def rpc_await(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """``[step_id, key, timeout]`` -> ``[found, value]`` once this trainer published it, or after the timeout."""
        try:
            step_id, key, timeout = msgpack.unpackb(request.serialized_info, raw=False)
            if type(step_id) is not int or not isinstance(key, str) or not isinstance(timeout, (int, float)):
                raise ValueError
            timeout = min(max(float(timeout), 0.0), 600.0)
        except Exception:
            return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb([False, "malformed request"]))
        loop = asyncio.get_running_loop()
        found, value = await loop.run_in_executor(None, self._wait_published, step_id, key, timeout)
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb([found, value], use_bin_type=True))

    def _wait_published(self, step_id: int, key: str, timeout: float) -> tuple[bool, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (step_id, key) not in self._published:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.p2p is None:
                    return False, None
                self._cond.wait(min(remaining, 0.5))
            return True, self._published[(step_id, key)]


async def _first_reply(responses: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The header and tensors of the one reply a stream carries (its messages up to the one with the header)."""
    receiver = MessageReceiver(max_bytes=_MAX_PART_BYTES)
    async for message in responses:
        if receiver.feed(message):
            return receiver.result()
    raise ConnectionError("the stream ended without a reply")


def _parse_result(reply: dict[str, Any], tensors: list[torch.Tensor], leader: str) -> StepResult:
    for key in ("step", "step_id", "trainers", "nonfinite"):
        if type(reply.get(key)) is not int:
            raise ValueError(f"malformed trainer step result: {key}")
    tensors_out = _decode_grads(tensors, reply.get("shapes"))
    count = reply.get("buffers", 0)
    if type(count) is not int or not 0 <= count <= len(tensors_out):
        raise ValueError("malformed trainer step result: buffers")
    grads, buffers = tensors_out[: len(tensors_out) - count], tensors_out[len(tensors_out) - count :]
    return StepResult(
        step=reply["step"],
        step_id=reply["step_id"],
        leader=leader,
        trainers=reply["trainers"],
        missing=[str(m) for m in reply.get("missing", [])],
        grads=grads,
        nonfinite=reply["nonfinite"],
        late=bool(reply.get("late", False)),
        names=[str(n) for n in reply.get("names", [])],
        buffers=buffers,
    )


def _stopping() -> BaseException:
    from lightning_swarm.swarm.lifetime import PeerStopping

    return PeerStopping("a trainers' step was abandoned: this peer is stopping")


def _check_late(rnd: _Round, part: _Part) -> None:
    """A part that came after its step was taken is not averaged, but its hash (if it carries one) is checked
    against the step's: a trainer whose parts are always late must not diverge unseen (under ``_cond``)."""
    mine = part.header.get("hash")
    theirs = {p.header.get("hash") for p in rnd.parts.values()} - {None}
    if mine is not None and theirs and mine not in theirs:
        rnd.late_errors[str(part.header["name"])] = _diverged(
            int(part.header["step"]), "a trainer's late part carries another hash than the step's"
        )


def _diverged(step: int, how: str) -> str:
    """The error of trainers whose own parameters differ at global step ``step`` (``how`` it shows)."""
    return (
        f"The trainers' own parameters differ at global step {step} ({how}): they no longer train one model. This "
        "is a bug of the swarm or of nondeterministic code in the module's trainer-side layers; report it with the "
        "run's logs."
    )


def _late(result: StepResult) -> StepResult:
    """``result`` as a trainer whose part came after the step was taken receives it."""
    return dataclasses.replace(result, late=True)


def _reply(body: dict[str, Any]) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=msgpack.packb(body, use_bin_type=True))
