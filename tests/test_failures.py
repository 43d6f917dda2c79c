"""A local swarm fails the way DDP does: an exception on any peer ends every peer within seconds, each raising it,
and nothing is left running; a peer whose hivemind helper process was killed still exits when training ends.

Real processes (``tests/_failure_job.py`` under the swarm's launcher), real hivemind on 127.0.0.1. Times come from
the clocks of the peers themselves (each writes when its ``fit`` ended; the first raise writes when it happened).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_swarm.swarm.dht.identity import PeerIdentity
from lightning_swarm.swarm.dht.validation import failure_key, record_validators
from tests import _zygote
from tests._helpers import SMALL_SWARM_STRATEGY, alive, run_launcher_job

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "_failure_job.py"
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="local swarms' lifetime is Linux only"
)

_STRATEGY = {**SMALL_SWARM_STRATEGY, "linger_timeout": 30.0}


def _run(tmp_path: Path, cfg: dict, timeout: float) -> tuple[int, str, dict[int, dict], list[int]]:
    """Run the job in its own session; returns its exit code, stderr, each peer's end record by rank, and the pids
    of every process it started that are still alive 15 s after it ended (none expected)."""
    cfg = {**cfg, "out": str(tmp_path)}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("LOCAL_RANK", None)
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = _zygote.Popen(
            [sys.executable, str(JOB), json.dumps(cfg)],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=f,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid_file in tmp_path.glob("pids?"):  # where each peer hangs, for the report
            for pid in pid_file.read_text().split()[:1]:
                if alive(int(pid)):
                    os.kill(int(pid), signal.SIGUSR1)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(
            f"the swarm did not end within {timeout} s:\n{err.read_text()[-8000:]}"
        ) from None
    pids = [int(p) for f in tmp_path.glob("pids?") for p in f.read_text().split()]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the session, so that no test leaks it
    except ProcessLookupError:
        pass
    ends = {}
    for f in tmp_path.glob("end?"):
        end = json.loads(f.read_text())
        ends[end["rank"]] = end
    return code, err.read_text(), ends, left


def _check_everyone_raised(tmp_path, code, stderr, ends, left, devices, types, message):
    assert code != 0, stderr[-5000:]
    assert message in stderr  # the launching peer (rank 0) is one of the peers checked below
    assert sorted(ends) == list(range(devices)), (sorted(ends), stderr[-5000:])
    raised = float((tmp_path / "raised").read_text())
    delays, seen = {}, {}
    for rank, end in sorted(ends.items()):
        assert end["error"] is not None, (rank, stderr[-5000:])
        assert set(types) & set(end["error"]["types"]), (rank, end)
        assert message in end["error"]["message"], (rank, end)
        delays[rank] = end["time"] - raised
        if end.get("seen") is not None:
            seen[rank] = end["seen"] - raised
    print(
        f"seconds from the first raise to each peer's raise: { {r: round(d, 1) for r, d in delays.items()} }; "
        f"to reading it in the DHT: { {r: round(d, 1) for r, d in seen.items()} }"
    )
    assert max(delays.values()) < 10.0, delays
    assert left == [], "processes of the failed swarm are still running"
    return delays


@pytest.mark.timeout(400)
def test_an_exception_in_a_block_on_one_peer_ends_every_peer_of_a_local_swarm(tmp_path) -> None:
    """devices=4, 2 stages, 2 trainers: the block of stage 1 raises on peer 3 (a server-only peer). The trainer
    whose call it served raises the ValueError, and every other peer raises it too (a ``PeerFailure`` that is also a
    ``ValueError``, naming the peer it came from) within 10 s; the launcher exits non-zero with the message."""
    cfg = {
        "devices": 4,
        "max_steps": 400,
        "fail": {"where": "block", "rank": 3},
        "strategy": {**_STRATEGY, "num_trainers": 2, "run_id": "fail_block"},
    }
    code, stderr, ends, left = _run(tmp_path, cfg, timeout=300)
    _check_everyone_raised(tmp_path, code, stderr, ends, left, 4, ["ValueError"], "user bug 4711")
    servers = [ends[2]["error"], ends[3]["error"]]
    assert all("PeerFailure" in e["types"] and "Swarm peer " in e["message"] for e in servers), servers


@pytest.mark.timeout(400)
def test_an_exception_in_one_trainers_training_step_ends_every_peer(tmp_path) -> None:
    """devices=4, every peer trains: peer 1's training_step raises a TypeError at step 3. Peer 1 raises it, every
    other peer raises it as a ``PeerFailure`` (also a ``TypeError``) naming peer 1, within 10 s."""
    cfg = {
        "devices": 4,
        "max_steps": 400,
        "fail": {"where": "step", "rank": 1, "step": 3},
        "strategy": {**_STRATEGY, "run_id": "fail_step"},
    }
    code, stderr, ends, left = _run(tmp_path, cfg, timeout=300)
    _check_everyone_raised(tmp_path, code, stderr, ends, left, 4, ["TypeError"], "user bug in training_step")
    assert ends[1]["error"]["types"][0] == "TypeError"  # the failing peer raises its own exception
    for rank in (0, 2, 3):
        assert "Swarm peer 1 (pid" in ends[rank]["error"]["message"], ends[rank]


@pytest.mark.timeout(300)
def test_a_peer_whose_averager_was_killed_still_exits_when_training_ends(tmp_path) -> None:
    """SIGKILL of a hivemind helper (peer 0's stage averager) is not a failure: both peers train every step, then
    exit (peer 0 within seconds of the end, with one warning about the dead helper and no traceback)."""
    cfg = {
        "devices": 2,
        "max_steps": 30,
        "kill_helper": {"rank": 0, "step": 5, "helper": "server.optimizer.state_averager"},
        "strategy": {**_STRATEGY, "run_id": "helper_killed"},
    }
    code, stderr, ends, left = _run(tmp_path, cfg, timeout=240)
    assert code == 0, stderr[-5000:]
    assert "`max_steps=30` reached" in stderr
    assert sorted(ends) == [0, 1] and all(e["error"] is None and e["steps"] == 30 for e in ends.values()), (
        ends
    )
    assert stderr.count("died during the run") == 1, stderr[-5000:]
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-5000:]
    assert left == []


_HELPERS = {  # what each case kills on peer 0 (see tests/_failure_job.py)
    "dht": {},
    "grad averager mid-round": {"helper": "server.optimizer.grad_averager", "during": "sum_in_named_group"},
    "state averager": {"helper": "server.optimizer.state_averager"},
    "progress tracker": {"helper": "server.optimizer.tracker"},
    "p2p daemon": {"helper": "p2pd"},
}
_STRATEGY_OF = {  # the strategy's settings a case needs
    # peers of one machine sum through shared memory, not the gradient averager
    "grad averager mid-round": {"same_host": False},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("helper", list(_HELPERS))
def test_a_peer_whose_helper_died_exits_when_training_ends(tmp_path, helper) -> None:
    """A hivemind helper of peer 0 dies in a swarm of 2 stages x 2 peers (SIGKILL of a process; a progress tracker, a
    thread, stops), with one warning and no traceback; nothing waits on it forever and nothing is left running.

    - its DHT process (its p2p daemon dies with it), or that p2p daemon alone, cuts peer 0 off the swarm: it stops
      as after SIGTERM, publishing nothing, and the three other peers train every step, as after a crash;
    - a helper of its stage's optimizer (the gradient averager killed during an averaging round, which it holds the
      averaged tensors' lock for; the state averager; the progress tracker): peer 0 leaves the stage to the stage's
      other peer and trains on; every peer trains every step and peer 0 exits with the others."""
    steps = 12
    run_id = "killed_" + "".join(c if c.isalnum() else "_" for c in helper)
    strategy = {**_STRATEGY, "run_id": run_id, **_STRATEGY_OF.get(helper, {})}
    cfg = {
        "devices": 4,
        "max_steps": steps,
        "kill_helper": {"rank": 0, "step": 3, **_HELPERS[helper]},
        "strategy": strategy,
    }
    code, stderr, ends, left = _run(tmp_path, cfg, timeout=240)
    assert code == 0, stderr[-5000:]
    assert sorted(ends) == [0, 1, 2, 3], stderr[-5000:]
    if helper in ("dht", "p2p daemon"):  # peer 0 can no longer reach the swarm
        assert "PeerStopping" in ends[0]["error"]["types"] and ends[0]["steps"] < steps, ends[0]
        trained = (1, 2, 3)
        said = "its DHT helper process" if helper == "dht" else "the p2p daemon of its DHT"
        assert stderr.count(said) == 1, stderr[-5000:]
    else:
        trained = (0, 1, 2, 3)
        assert stderr.count("died during the run") == 1, stderr[-5000:]
    assert all(ends[r]["error"] is None and ends[r]["steps"] == steps for r in trained), ends
    assert ends[0]["time"] - min(ends[r]["time"] for r in trained) < 30.0, ends
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-5000:]
    assert left == []


def test_a_peer_that_exits_with_an_error_is_not_restarted_and_fails_the_launching_peer(tmp_path) -> None:
    """The launcher's own route, for a peer that fails before it could publish its error: an error exit status
    is a failure (not restarted, unlike a kill), raised once in the launching peer after the grace period."""
    res, seen = run_launcher_job(tmp_path, "fail")
    assert seen["deaths"] == [[1, 3]] and seen["restarts"] == {}, seen
    assert seen["early"] is None and seen["again"] is None, seen
    assert seen["raised"].startswith("Swarm peer 1 (pid ") and "exit code 3" in seen["raised"], seen
    assert "failed (exit code 3): the swarm stops with its error" in res.stderr


def test_failure_records_are_signed_and_schema_checked() -> None:
    """The failure key is one of the swarm's protected keys: a record with the wrong shape is refused."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    identity = PeerIdentity()
    schema, signer = record_validators("run", 2, identity)
    key = failure_key("run")

    def record(value, signed=True):
        r = DHTRecord(
            key=DHTID.generate(source=key).to_bytes(),
            subkey=MSGPackSerializer.dumps(identity.subkey),
            value=MSGPackSerializer.dumps(value),
            expiration_time=time.time() + 60,
        )
        return DHTRecord(r.key, r.subkey, signer.sign_value(r), r.expiration_time) if signed else r

    good = ["ValueError", "user bug", "Swarm peer 1", 1.0]
    assert signer.validate(record(good)) and schema.validate(record(good, signed=False))
    assert not schema.validate(record(["ValueError", "user bug", 3, 1.0], signed=False))
    assert not schema.validate(record(["ValueError", "x" * 9000, "Swarm peer 1", 1.0], signed=False))
    unsigned = record(good, signed=False)
    assert not signer.validate(unsigned)


def _sleep_long() -> None:
    time.sleep(60)


def test_shutdown_steps_are_bounded_and_dead_helpers_are_reported_once(caplog) -> None:
    """A shutdown step that hangs is left behind after its timeout; a helper killed by a signal is reported (and
    hivemind's own shutdown of it skipped), one that ended by itself is not."""
    import multiprocessing as mp
    import threading

    from lightning_swarm.swarm.lifetime import bounded, settle_dead_helpers

    release = threading.Event()
    started = time.monotonic()
    assert not bounded("a hanging step", lambda: release.wait(30), timeout=0.5)
    assert time.monotonic() - started < 5
    release.set()
    assert bounded("a quick step", lambda: None, timeout=5)
    assert "a hanging step did not finish" in caplog.text

    ctx = mp.get_context("fork")
    killed, ended = ctx.Process(target=_sleep_long, daemon=True), ctx.Process(target=time.sleep, args=(0,))
    for process in (killed, ended):
        process.start()
    os.kill(killed.pid, signal.SIGKILL)
    for process in (killed, ended):
        process.join(10)
    dead = settle_dead_helpers(
        [("stage 0 state averager", killed), ("trainer state averager", ended), ("x", None)]
    )
    assert dead == [f"stage 0 state averager (pid {killed.pid}, signal 9)"]
    assert settle_dead_helpers([("stage 0 state averager", killed)]) == []  # each death is reported once
    killed.shutdown()  # replaced: hivemind would log an error for a process already gone


def _hold_hivemind_future_locks(held) -> None:
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    MPFuture._update_lock.__enter__()
    SharedBytes._lock.__enter__()
    held.set()
    time.sleep(600)


def test_a_helper_killed_holding_hivemind_s_future_locks_hangs_no_other_helper() -> None:
    """A helper SIGKILLed while it held the locks that hivemind's futures share between processes (the answers'
    pipe, the shared state's allocation): the peer's next DHT starts, and its calls are answered. Both with the dead
    helper still a zombie (not yet reaped by its peer) and reaped."""
    import multiprocessing as mp

    from lightning_swarm.swarm.dht.process import SwarmDHT
    from lightning_swarm.swarm.lifetime import robust_helper_locks

    robust_helper_locks()
    ctx = mp.get_context("fork")
    for reaped in (False, True):
        held = ctx.Event()
        holder = ctx.Process(target=_hold_hivemind_future_locks, args=(held,), daemon=True)
        holder.start()
        assert held.wait(30)
        os.kill(holder.pid, signal.SIGKILL)
        if reaped:
            holder.join(10)
        else:
            deadline = time.monotonic() + 10
            while alive(holder.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert not alive(holder.pid)
        started = time.monotonic()
        dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            assert dht.store("key", "value", expiration_time=time.time() + 60)
            assert dht.get("key", latest=True).value == "value"
        finally:
            dht.shutdown()
            holder.join(10)
        assert time.monotonic() - started < 30
