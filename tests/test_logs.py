"""What a swarm prints: routine hivemind records are lowered, real failures are left as they are."""

from __future__ import annotations

import logging
import sys

import pytest
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from lightning_swarm.swarm.logs import RoutineFilter


def _raise(error: BaseException) -> None:
    raise error


def _record(name: str, msg: str, error: BaseException | None, raiser=_raise) -> logging.LogRecord:
    """An ERROR record of ``msg``, carrying ``error`` as raised by ``raiser`` (whose name is the frame hivemind's
    record would show)."""
    exc_info = None
    if error is not None:
        try:
            raiser(error)
        except type(error):
            exc_info = sys.exc_info()
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), exc_info)


def test_a_state_download_from_a_dead_donor_is_one_warning_line_and_real_errors_stay() -> None:
    error = ControlFailure(
        "Connect failed. msg=failed to dial: failed to dial 12D3KooWQm: all dials failed\n"
        "  * [/ip4/127.0.0.1/tcp/46733] dial tcp4 127.0.0.1:46733: connect: connection refused"
    )
    record = _record(
        "hivemind.averaging.averager", f"Failed to download state from 12D3KooWQm - {error!r}", error
    )
    assert RoutineFilter().filter(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "\n" not in record.getMessage() and "12D3KooWQm" in record.getMessage()

    other = _record(
        "hivemind.averaging.averager", "Failed to download state from X - ValueError('bad')", None
    )
    other.exc_info = _record("x", "", ValueError("corrupt state")).exc_info
    assert RoutineFilter().filter(other)
    assert other.levelno == logging.ERROR and other.exc_info is not None  # not routine: left as it is


def test_a_zero_weight_round_that_found_no_partner_is_not_an_error() -> None:
    """hivemind's optimizer logs a failed round it joined with zero weight ("tagging along") with a traceback at
    ERROR; when its partner was killed that is routine (CI printed one in the killed-peer test)."""
    from hivemind.averaging.partition import AllreduceException

    def _tag_along_with_zero_weight(error: BaseException) -> None:  # the frame hivemind's record carries
        raise error

    def record_of(error: BaseException) -> logging.LogRecord:
        return _record("hivemind.optim.optimizer", str(error), error, _tag_along_with_zero_weight)

    routine = record_of(AllreduceException("Averaging step failed: could not find a group"))
    assert not RoutineFilter().filter(routine)  # DEBUG: below hivemind's level, dropped
    real = record_of(ValueError("tensor size mismatch"))
    assert RoutineFilter().filter(real) and real.levelno == logging.ERROR and real.exc_info is not None
    elsewhere = _record(
        "hivemind.optim.optimizer", "could not find a group", RuntimeError("could not find a group")
    )
    assert RoutineFilter().filter(elsewhere) and elsewhere.levelno == logging.ERROR  # not a tag-along: left


def test_an_incomplete_state_download_is_one_warning_line() -> None:
    """hivemind's optimizer logs an IndexError from ``load_optimizer_state`` (a downloaded state with fewer optimizer
    statistics than its metadata lists) at ERROR with a traceback, then retries; it logs the opposite mismatch as a
    WARNING. Seen once in CI in the 4-peer LM test."""

    def load_optimizer_state(error: BaseException) -> None:  # the frame hivemind's record carries
        raise error

    record = _record(
        "hivemind.optim.optimizer",
        "Failed to load state from peers: list index out of range, retrying ...",
        IndexError("list index out of range"),
        load_optimizer_state,
    )
    assert RoutineFilter().filter(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "incomplete" in record.getMessage() and "\n" not in record.getMessage()
    other = _record(
        "hivemind.optim.optimizer", "Failed to load state from peers: boom, retrying ...", KeyError("x")
    )
    assert RoutineFilter().filter(other) and other.levelno == logging.ERROR  # another failure: left as it is


_SHARER_SCRIPT = r"""
import os, socket, sys, time
from multiprocessing import resource_sharer
from multiprocessing.connection import Client
quiet = sys.argv[1] == "quiet"
if quiet:
    from lightning_swarm.swarm.logs import quiet_routine_logs
    quiet_routine_logs()
r, w = os.pipe()
dup = resource_sharer.DupFd(r)  # starts the sharer's serving thread, as sending a tensor through a pipe does
address = dup._id[0]
# a receiver that dies mid-handshake: connect, then go away before answering the challenge
family = "AF_UNIX" if isinstance(address, str) else "AF_INET"
s = socket.socket(socket.AF_UNIX if family == "AF_UNIX" else socket.AF_INET)
s.connect(address)
s.close()
time.sleep(0.5)
if quiet:  # any other uncaught exception still reaches the previous hook
    sys.excepthook(ValueError, ValueError("not routine"), None)
print("done", flush=True)
"""


def test_a_receiver_dying_in_the_resource_sharer_is_not_a_traceback(tmp_path) -> None:
    """Real ``multiprocessing`` resource sharer: a receiver that disconnects mid-handshake prints a traceback
    through ``sys.excepthook``, unless :func:`quiet_routine_logs` is installed; other exceptions still print."""
    import subprocess

    script = tmp_path / "sharer.py"
    script.write_text(_SHARER_SCRIPT)
    loud = subprocess.run([sys.executable, str(script), "loud"], capture_output=True, text=True, timeout=60)
    assert "done" in loud.stdout and "Traceback" in loud.stderr and "resource_sharer" in loud.stderr
    quiet = subprocess.run([sys.executable, str(script), "quiet"], capture_output=True, text=True, timeout=60)
    assert "done" in quiet.stdout and "resource_sharer" not in quiet.stderr, quiet.stderr
    assert "ValueError: not routine" in quiet.stderr


_VANISHED_SENDER_SCRIPT = r"""
import multiprocessing, socket, sys, time
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
import torch
import hivemind
from lightning_swarm.swarm.footprint import trim_footprint
trim_footprint()  # as a swarm peer: tensors are shared by file descriptor, handed over by the resource sharer
if sys.argv[1] == "quiet":
    from lightning_swarm.swarm.logs import quiet_routine_logs
    quiet_routine_logs()
dht = hivemind.DHT(start=True)


def send_and_vanish():  # sends the DHT a request carrying a tensor, then vanishes mid-handshake
    shared = torch.zeros(4).share_memory_()
    message = bytes(ForkingPickler.dumps(("get", (shared,), {})))  # registers the tensor's fd with this sharer
    address = resource_sharer._resource_sharer._address
    resource_sharer._resource_sharer.stop()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(1)
    dht._outer_pipe.send_bytes(message)
    conn, _ = listener.accept()  # the DHT process asks for the descriptor: the sender is gone before answering
    conn.close()


sender = multiprocessing.get_context("fork").Process(target=send_and_vanish)
sender.start()
sender.join()
assert sender.exitcode == 0
time.sleep(1.0)
assert dht.is_alive(), "the DHT process died"
dht.store("key", "value", hivemind.utils.get_dht_time() + 60)
assert dht.get("key", latest=True).value == "value"
dht.shutdown()
print("done", flush=True)
"""


def test_a_dht_request_whose_sender_vanished_is_dropped_not_fatal(tmp_path) -> None:
    """Real hivemind DHT process and ``multiprocessing`` resource sharer: a request carrying a tensor from a
    process that exits mid-handshake ends the DHT process with a traceback, unless :func:`quiet_routine_logs` is
    installed; then the DHT drops that request quietly and keeps serving."""
    import subprocess

    script = tmp_path / "vanished.py"
    script.write_text(_VANISHED_SENDER_SCRIPT)
    runs = {
        mode: subprocess.Popen(
            [sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for mode in ("loud", "quiet")
    }
    (loud_out, loud_err), (quiet_out, quiet_err) = (
        runs[m].communicate(timeout=120) for m in ("loud", "quiet")
    )
    assert "EOFError" in loud_err and "done" not in loud_out, loud_err[-3000:]
    assert "done" in quiet_out, quiet_err[-3000:]
    assert "Traceback" not in quiet_err and "ERROR" not in quiet_err, quiet_err[-3000:]


_TRACKER_SCRIPT = r"""
import logging, sys, time
import hivemind
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.mpfuture import MPFuture
from lightning_swarm.swarm.training.averaging import SwarmProgressTracker

class StalledLookups:
    # a real DHT whose asynchronous lookups never answer (a busy DHT, or one going away): a tracker shutting down
    # meanwhile has a lookup in flight
    def __init__(self, dht):
        self.dht, self.pending = dht, []
    def __getattr__(self, name):
        return getattr(self.dht, name)
    def get(self, *args, return_future=False, **kwargs):
        if not return_future:
            return self.dht.get(*args, **kwargs)
        self.pending.append(MPFuture())
        return self.pending[-1]

dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
stalled = StalledLookups(dht)
cls = ProgressTracker if sys.argv[1] == "hivemind" else SwarmProgressTracker
tracker = cls(dht=stalled, prefix="tracker_test", target_batch_size=8, client_mode=False,
              status_loglevel=logging.DEBUG, start=True, default_refresh_period=0.2, min_refresh_period=0.1)
deadline = time.monotonic() + 20
while not stalled.pending and time.monotonic() < deadline:
    time.sleep(0.05)
assert stalled.pending, "the tracker never looked up the swarm's progress"
tracker.shutdown(timeout=10)
tracker.join(timeout=10)
assert not tracker.is_alive()
dht.shutdown()
print("done", flush=True)
"""


@pytest.mark.parametrize("tracker", ["hivemind", "swarm"])
def test_a_progress_tracker_shut_down_mid_lookup_leaves_no_pending_task(tracker) -> None:
    """hivemind 1.1.12's tracker leaves its in-flight lookup pending on a loop it never closes: asyncio logs "Task
    was destroyed but it is pending!" at ERROR when the loop is collected, typically at the process's exit (seen at
    the end of test runs). Stage servers and trainers use the swarm's tracker, which finishes its tasks first."""
    import subprocess

    run = subprocess.run(
        [sys.executable, "-c", _TRACKER_SCRIPT, tracker], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-3000:]
    if tracker == "hivemind":
        assert "Task was destroyed but it is pending" in run.stderr, (
            "the injected fault no longer reproduces it"
        )
    else:
        assert "Task was destroyed" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]


class _UnreadableRequest:
    """Unpickles with ``FileNotFoundError``, as a request does whose future's shared state belonged to a process
    that has exited (an averager shut down at the end of a run)."""

    def __reduce__(self):
        import os

        return (os.open, ("/nonexistent/lightning-swarm-sender-gone", os.O_RDONLY))


@pytest.mark.parametrize("dht_class", ["SwarmDHT", "hivemind.DHT"])
def test_a_dht_request_that_cannot_be_read_is_dropped_without_a_pause(dht_class: str) -> None:
    """Real DHT process: 2 unreadable requests ahead of a store and a get. hivemind's DHT sleeps 3 s after each
    (6 s, during which every DHT call of the peer waits: at the end of a 4-peer run it met 53, most of a minute);
    :class:`SwarmDHT` drops them at once."""
    import time

    import hivemind
    from hivemind.utils import get_dht_time

    from lightning_swarm.swarm.dht.process import SwarmDHT

    dht = (SwarmDHT if dht_class == "SwarmDHT" else hivemind.DHT)(start=True)
    try:
        for _ in range(2):
            dht._outer_pipe.send(_UnreadableRequest())
        start = time.monotonic()
        assert dht.store("key", 42, get_dht_time() + 60)
        assert dht.get("key", latest=True).value == 42
        took = time.monotonic() - start
    finally:
        dht.shutdown()
    if dht_class == "SwarmDHT":
        assert took < 4.0, took  # a busy CI box: well below the 6 s each unreadable request costs hivemind
    else:  # the bug this works around, still in the pinned hivemind
        assert took > 5.0, took


class _TruncatedRequest:
    """Unpickles with ``EOFError``, as a request does whose sender exits while the DHT process fetches its future's
    shared state (``multiprocessing.resource_sharer``'s socket closes under ``recv_handle``)."""

    def __reduce__(self):
        import pickle

        return (pickle.loads, (b"",))


@pytest.mark.parametrize("dht_class", ["SwarmDHT", "hivemind.DHT"])
def test_a_dht_request_cut_short_by_its_sender_does_not_kill_the_dht_process(dht_class: str) -> None:
    """Real DHT process: a request whose unpickling raises ``EOFError`` killed hivemind's DHT process (exit code 1,
    and the peer with it); :class:`SwarmDHT` drops it and serves the next request."""
    import hivemind
    from hivemind.utils import get_dht_time

    from lightning_swarm.swarm.dht.process import SwarmDHT

    dht = (SwarmDHT if dht_class == "SwarmDHT" else hivemind.DHT)(start=True)
    try:
        dht._outer_pipe.send(_TruncatedRequest())
        if dht_class == "SwarmDHT":  # bounded waits: a dead DHT process never answers
            assert dht.store("key", 42, get_dht_time() + 60, return_future=True).result(timeout=20)
            assert dht.get("key", latest=True, return_future=True).result(timeout=20).value == 42
            assert dht.is_alive()
        else:  # the bug this works around, still in the pinned hivemind
            dht.join(timeout=30)
            assert dht.exitcode == 1, dht.exitcode
    finally:
        dht.shutdown()
