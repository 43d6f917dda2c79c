"""Peer presence and the end-of-run handshake of a swarm.

Every peer keeps a small DHT record ``{run_id}.peers.0`` (subkey: its peer id, signed on a swarm peer's DHT: see
:mod:`.records`) with its *phase* and whether it
trains: ``[phase, trainer]``. Phase 0 while it trains, 1 once it has finished training (it still serves its
stage), 2 once it has gathered what it needs and may leave. A peer leaves only when every live peer has reached
the phase it waits for, so a trainer that finishes early keeps serving the others, and checkpoints gathered at the
end see the final weights. Records expire (``3 * period`` seconds), so a peer that dies drops out of the count.

Bounded waits (:meth:`Presence.wait_for`):

- A DHT read that fails, or that finds no record at all (not even this peer's own), is *unknown*: it never counts
  as "nobody else is here". A peer gives up once reads have been unknown for ``unreadable_timeout`` seconds in a row
  (default 60 s), or after the caller's ``timeout``.
- In a local swarm of N peers, a peer waits for N peers to have appeared at least once; peers that never appear
  within ``appear_timeout`` seconds (default 120 s) are not waited for. A peer that appeared and died is not
  waited for once its record has expired (6 s by default): the presence thread reads the records every ``period``
  while the peer trains, so a peer that lived only mid-run counts as having appeared.
- A server-only peer waits for trainers (``trainers_only``): for them to appear, without limit (a server started
  before any trainer keeps serving), then until every live trainer has finished or died.
- A peer whose DHT helper process died reads nothing any more: its waits end at once.

Failures. A run fails the way DDP's does: a peer whose run raised an exception publishes it
(:meth:`Presence.publish_failure`: ``[type name, message, origin, time]`` under ``{run_id}.failure.0``, kept
``FAILURE_TTL`` seconds), and the presence thread of every other peer reads that key every ``FAILURE_POLL_S``; then
:meth:`Presence.check_failure` raises the earliest failure as a :class:`PeerFailure` (also an instance of the
failed peer's exception type where that is a built-in), which the peer's waits and stage calls poll. A peer that is
killed (SIGKILL, preemption) publishes nothing: the others retry its calls elsewhere and carry on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from lightning_swarm.swarm.dht.identity import identity_of, strip_signature, subkey_peer_id
from lightning_swarm.swarm.dht.validation import failure_key, presence_key
from lightning_swarm.swarm.lifetime import running_parent
from lightning_swarm.swarm.states import TRAINING
from lightning_swarm.swarm.wire.errors import remote_class

logger = logging.getLogger(__name__)

UNREADABLE_TIMEOUT = 60.0
APPEAR_TIMEOUT = 120.0
_DHT_TIMEOUT = 10.0  # seconds one DHT read or write may take
FAILURE_TTL = 30.0  # seconds a published failure stays in the DHT (and fails a new run of the same run_id)
# seconds between two reads of the failure records: each read is a DHT get whose signed records every node it
# reaches verifies; every second on every peer it cost the main job (6 peers on 2 cores) ~5% of its throughput
FAILURE_POLL_S = 2.0
_MESSAGE_CHARS = 4000  # a failure's message is cut to this length


def _key(run_id: str) -> str:
    return presence_key(run_id)


class PeerFailure(RuntimeError):
    """Another peer of the swarm raised an exception: this peer stops with it, as the ranks of a DDP run do.

    Where the failed peer's exception type is a Python built-in, the exception raised is also an instance of it
    (``except ValueError`` catches a ``ValueError`` raised on another peer).

    Attributes:
        type_name: the name of the failed peer's exception type.
        remote_message: its message.
        origin: the failed peer, in words (index in a local swarm, pid, host, peer id).
    """

    def __init__(self, type_name: str, remote_message: str, origin: str) -> None:
        super().__init__(
            f"{origin} raised {type_name}: {remote_message}\nThe swarm stops with that error, as a DDP run does when "
            "one of its processes fails: its traceback is in that peer's output; fix the error there and start the "
            "run again."
        )
        self.type_name, self.remote_message, self.origin = type_name, remote_message, origin


def peer_failure(type_name: str, message: str, origin: str) -> PeerFailure:
    """The exception this peer raises for another peer's failure (a subclass of the built-in type, if any)."""
    cls: Any = remote_class(type_name, PeerFailure, prefix="Peer")
    return cls(type_name, message, origin)


def dht_alive(dht: hivemind.DHT) -> bool:
    """Whether ``dht`` can still reach the swarm: its process runs, and so does the p2p daemon it talks through
    (:func:`p2pd_alive`). A DHT this process did not start is assumed to."""
    try:
        if not dht.is_alive():
            return False
    except (AssertionError, AttributeError, ValueError):  # a DHT this process did not start: assume it lives
        return True
    return p2pd_alive(dht)


def p2pd_pid(dht: hivemind.DHT) -> int | None:
    """The pid of the p2p daemon that ``dht``'s process started (hivemind's ``p2pd``; the peer's own calls go
    through it too), found once among that process's children; ``None`` where there is none to find (not Linux,
    or a DHT on a daemon it did not start)."""
    found = getattr(dht, "_swarm_p2pd_pid", 0)
    if found != 0:
        return found if found > 0 else None
    pid = -1
    try:
        for task in os.listdir(f"/proc/{dht.pid}/task"):
            with open(f"/proc/{dht.pid}/task/{task}/children") as f:
                for child in f.read().split():
                    with open(f"/proc/{child}/comm") as comm:
                        if comm.read().strip() == "p2pd":
                            pid = int(child)
    except (OSError, ValueError):
        pass
    dht._swarm_p2pd_pid = pid
    return pid if pid > 0 else None


def p2pd_alive(dht: hivemind.DHT) -> bool:
    """Whether the p2p daemon of ``dht``'s process runs (a SIGKILLed daemon is a zombie until that process reaps
    it); ``True`` where it cannot be told."""
    pid = p2pd_pid(dht)
    return pid is None or running_parent(pid) == dht.pid  # (a reused pid has another parent)


class Presence:
    """Announces this peer's phase and waits for the others'.

    Args:
        dht: the running DHT of this peer.
        run_id: the swarm's run id.
        peer_name: this peer's name in :meth:`records` (its base58 peer id); on a DHT with a
            :class:`~.records.PeerIdentity` its record is written under the signed subkey of that id.
        period: seconds between announcements; a record lives ``3 * period`` seconds.
        trainer: whether this peer feeds data (server-only peers wait for trainers).
        unreadable_timeout: seconds of consecutive failed DHT reads after which a waiting peer gives up.
        appear_timeout: seconds a peer of a local swarm waits for the expected peers to appear at least once.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        peer_name: str,
        period: float = 2.0,
        trainer: bool = True,
        unreadable_timeout: float = UNREADABLE_TIMEOUT,
        appear_timeout: float = APPEAR_TIMEOUT,
    ) -> None:
        self.dht, self.run_id, self.peer_name, self.period = dht, run_id, peer_name, period
        self.trainer = trainer
        self.unreadable_timeout, self.appear_timeout = unreadable_timeout, appear_timeout
        self.phase = TRAINING
        identity = identity_of(dht)
        signed = identity is not None and identity.peer_id.to_base58() == peer_name
        self._subkey: bytes | str = identity.subkey if signed and identity is not None else peer_name
        self.seen: set[str] = set()  # every peer ever seen in this run
        self.seen_trainers: set[str] = set()
        self.failure: PeerFailure | None = None  # the earliest failure another peer published
        self.failure_seen_at: float | None = None  # when (``time.time()``) this peer read it
        self._failed_here = False  # this peer published its own failure: it raises its own exception
        self._started_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-presence", daemon=True)

    def start(self) -> None:
        self._started_at = time.monotonic()
        self._announce()
        self._thread.start()

    def set_phase(self, phase: int) -> None:
        self.phase = max(self.phase, phase)
        self._announce()

    def records(self) -> dict[str, tuple[int, bool]] | None:
        """``(phase, trainer)`` of every live peer by subkey, this one included; ``None`` when the DHT could not be
        read (an empty answer counts as unreadable: this peer's own record should be there). Malformed records are
        ignored."""
        if not dht_alive(self.dht):
            return None
        try:
            found = self.dht.get(_key(self.run_id), latest=True, return_future=True).result(
                timeout=_DHT_TIMEOUT
            )
        except Exception as e:  # including a timeout: a DHT process that died never answers
            logger.debug(f"Presence: DHT read failed: {e!r}")
            return None
        if found is None or not isinstance(found.value, dict):
            return None  # this peer's own record should be there: an empty answer means the read failed
        out: dict[str, tuple[int, bool]] = {}
        for subkey, entry in found.value.items():
            try:  # a signed subkey names its peer id (the DHT's validators reject the others on a swarm peer)
                name = subkey if isinstance(subkey, str) else subkey_peer_id(subkey).to_base58()
            except Exception:
                continue
            value = strip_signature(getattr(entry, "value", None))
            if isinstance(value, int) and not isinstance(value, bool):  # an older peer: phase only
                value = [value, True]
            if (
                isinstance(value, (list, tuple))
                and len(value) == 2
                and isinstance(value[0], int)
                and not isinstance(value[0], bool)
            ):
                out[name] = (value[0], bool(value[1]))
        out[self.peer_name] = (self.phase, self.trainer)
        self.seen.update(out)
        self.seen_trainers.update(name for name, (_, trainer) in out.items() if trainer)
        return out

    def phases(self) -> dict[str, int] | None:
        """Phase of every live peer by subkey; ``None`` when unknown (see :meth:`records`)."""
        records = self.records()
        return None if records is None else {name: phase for name, (phase, _) in records.items()}

    def wait_for(
        self,
        phase: int,
        expected_peers: int | None,
        timeout: float,
        trainers_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
        on_wait: Callable[[list[str]], None] | None = None,
    ) -> bool:
        """Block until every live peer (every live trainer, with ``trainers_only``) has reached ``phase``; return
        False if that does not happen in time (see the module docstring for the bounds).

        Args:
            phase: the phase to wait for.
            expected_peers: in a local swarm, how many peers it has (each is waited for until it has appeared at
                least once, or ``appear_timeout`` has passed); ``None`` elsewhere.
            timeout: seconds to wait at most (``inf``: no limit besides ``unreadable_timeout``).
            trainers_only: wait for trainers only, and for at least one to have appeared (server-only peers).
            should_stop: polled between reads; once it returns True (this peer got SIGTERM), return False.
            on_wait: called once, with the names of the peers behind (empty: expected peers have not appeared
                yet), when the first read shows that this peer has to wait.
        """
        start = time.monotonic()
        deadline = start + timeout
        last_read = start
        while True:
            if should_stop is not None and should_stop():
                return False
            if not dht_alive(self.dht):
                logger.warning(
                    f"Gave up waiting for the swarm to reach phase {phase}: this peer's DHT process died"
                )
                return False
            records = self.records()
            now = time.monotonic()
            if records is not None:
                last_read = now
                appeared = (
                    expected_peers is None
                    or len(self.seen) >= expected_peers
                    or now - self._started_at > self.appear_timeout
                )
                if trainers_only:
                    appeared = appeared and bool(self.seen_trainers)
                waited = [p for p, trainer in records.values() if trainer or not trainers_only]
                if appeared and all(p >= phase for p in waited):
                    return True
                if on_wait is not None:
                    on_wait(
                        sorted(
                            name
                            for name, (p, trainer) in records.items()
                            if p < phase and (trainer or not trainers_only)
                        )
                    )
                    on_wait = None
            elif now - last_read > self.unreadable_timeout:
                logger.warning(
                    f"Gave up waiting for the swarm to reach phase {phase}: the DHT could not be read for "
                    f"{self.unreadable_timeout:.0f} s"
                )
                return False
            if now > deadline:
                behind = sorted(
                    name
                    for name, (p, trainer) in (records or {}).items()
                    if p < phase and (trainer or not trainers_only)
                )
                logger.warning(
                    f"Gave up waiting for the swarm to reach phase {phase} after {timeout:.0f} s "
                    f"({len(records or {})} peers seen now, behind: {behind})"
                )
                return False
            time.sleep(min(0.5, self.period))

    def publish_failure(self, type_name: str, message: str, origin: str) -> bool:
        """Tell every peer of the run that this peer's run raised ``type_name: message`` (they stop with it, see the
        module docstring); returns whether the DHT took the record. Bounded by the DHT timeout."""
        self._failed_here = True
        if len(message) > _MESSAGE_CHARS:
            message = message[: _MESSAGE_CHARS - 15] + " [... cut here]"
        if not dht_alive(self.dht):
            return False
        try:
            return bool(
                self.dht.store(
                    failure_key(self.run_id),
                    [type_name[:200], message, origin[:500], float(get_dht_time())],
                    get_dht_time() + FAILURE_TTL,
                    subkey=self._subkey,
                    return_future=True,
                ).result(timeout=_DHT_TIMEOUT)
            )
        except Exception as e:
            logger.warning(f"Could not tell the swarm about this peer's failure: {e!r}")
            return False

    def check_failure(self) -> None:
        """Raise the earliest failure another peer of the run published (a :class:`PeerFailure`), if any and if this
        peer has not failed itself (it raises its own exception then)."""
        if self.failure is not None and not self._failed_here:
            raise self.failure

    def read_failure(self) -> PeerFailure | None:
        """Read the run's failure records (one DHT lookup) and keep the earliest as :attr:`failure`."""
        if self.failure is not None or not dht_alive(self.dht):
            return self.failure
        try:
            found = self.dht.get(failure_key(self.run_id), latest=True, return_future=True).result(
                timeout=_DHT_TIMEOUT
            )
        except Exception as e:
            logger.debug(f"Presence: DHT read of the failures failed: {e!r}")
            return None
        if found is None or not isinstance(found.value, dict):
            return None
        earliest: tuple[float, list] | None = None
        for subkey, entry in found.value.items():
            try:
                name = subkey if isinstance(subkey, str) else subkey_peer_id(subkey).to_base58()
            except Exception:
                continue
            if name == self.peer_name:
                continue  # this peer's own failure
            value = strip_signature(getattr(entry, "value", None))
            if not (
                isinstance(value, list) and len(value) == 4 and all(isinstance(v, str) for v in value[:3])
            ):
                continue
            when = value[3] if isinstance(value[3], float) else float("inf")
            if earliest is None or when < earliest[0]:
                earliest = (when, value)
        if earliest is not None:
            type_name, message, origin, _ = earliest[1]
            self.failure = peer_failure(type_name, message, origin)
            self.failure_seen_at = time.time()
        return self.failure

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.period + 1)

    def _announce(self) -> None:
        if not dht_alive(self.dht):
            return
        try:
            self.dht.store(
                _key(self.run_id),
                [self.phase, self.trainer],
                get_dht_time() + 3 * self.period,
                subkey=self._subkey,
                return_future=True,
            ).result(timeout=_DHT_TIMEOUT)
        except Exception as e:  # the DHT may be shutting down; presence is best effort
            logger.debug(f"Presence announcement failed: {e!r}")

    def _run(self) -> None:
        next_announce = time.monotonic() + self.period
        while not self._stop.wait(min(FAILURE_POLL_S, self.period)):
            if time.monotonic() >= next_announce:
                next_announce = time.monotonic() + self.period
                self._announce()
                if not self._stop.is_set():
                    self.records()  # keeps ``seen`` current: a peer that appears and dies mid-run was still here
            if not self._stop.is_set():
                self.read_failure()
