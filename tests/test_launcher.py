"""Process lifetime of a local swarm: a dead peer does not stop the others, and nothing outlives its parent."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._helpers import SMALL_SWARM_STRATEGY, alive, run_launcher_job

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")


def _wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_forked_helpers_die_with_their_peer(tmp_path):
    """Helpers forked by the main thread and by another thread both die when their peer is SIGKILLed."""
    script = textwrap.dedent(
        f"""
        import multiprocessing as mp, threading, time, sys
        sys.path.insert(0, {str(ROOT)!r})
        from lightning_swarm.swarm.lifetime import die_with_parent

        def sleep():
            time.sleep(120)

        die_with_parent()
        ctx = mp.get_context("fork")
        a = ctx.Process(target=sleep, daemon=True); a.start()
        box = []
        def fork_in_thread():
            b = ctx.Process(target=sleep); b.start(); box.append(b)
        t = threading.Thread(target=fork_in_thread); t.start(); t.join()  # the forking thread is gone now
        time.sleep(1.0)
        print(a.pid, box[0].pid, flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids), (
            "both helpers outlive the thread that forked them"
        )
        proc.kill()
        proc.wait()
        assert _wait_dead(pids) == []
    finally:
        proc.kill()


def test_dead_peer_is_restarted_and_the_others_carry_on(tmp_path):
    res, seen = run_launcher_job(tmp_path, "restart")
    assert seen["deaths"] == [[1, -signal.SIGKILL]]
    assert seen["restarts"] == {"1": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer0.0", "peer1.1", "peer2.0"]
    assert "died (signal 9); started a replacement" in res.stderr
    assert "Traceback" not in res.stderr


def test_nothing_outlives_a_killed_launcher(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "_launcher_job.py"), str(tmp_path), "hold"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("pids?"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p) for f in sorted(tmp_path.glob("pids?")) for p in f.read_text().split()]
        assert len(pids) == 6 and all(alive(p) for p in pids)
        assert proc.pid in pids
        proc.kill()
        proc.wait()
        assert _wait_dead(pids) == [], "peer processes or their helpers outlived the launcher"
    finally:
        proc.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_to_the_process_group_stops_a_training_local_swarm_promptly(tmp_path, sig):
    """What a terminal's Ctrl-C or a job runner's stop does: every process of the group gets the signal while the
    swarm trains. The peers stop at once (a call waiting for a stopped stage does not wait out
    ``no_peers_timeout``), quietly, and nothing they started is left."""
    cfg = {
        "model": "seq",
        "lr": 0.01,
        "devices": 2,
        "max_steps": 100_000,
        "out": str(tmp_path / "out.pt"),
        "pids_dir": str(tmp_path),
        "strategy": {
            **SMALL_SWARM_STRATEGY,
            "run_id": f"signal_{sig.name}",
        },
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("LOCAL_RANK", None)
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "swarm_job.py"), json.dumps(cfg)],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=f,
            start_new_session=True,  # its own process group, as a job started from a terminal
            # a shell starts background jobs with SIGINT ignored; a terminal's foreground job has it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pids?"))) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, err.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(3.0)  # both peers are training
        pids = [int(p) for f in tmp_path.glob("pids?") for p in f.read_text().split()]
        assert len(pids) >= 2 * 3 and all(alive(p) for p in pids)  # each peer: itself, DHT, p2pd...
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in pids}
        assert "p2pd" in names and "torch_shm_manag" not in names, (
            names
        )  # no shm manager (swarm/footprint.py)
        signalled = time.monotonic()
        os.killpg(proc.pid, sig)
        code = proc.wait(timeout=60)
        stopped = time.monotonic() - signalled
        assert _wait_dead(pids, timeout=15) == [], "processes of the local swarm outlived it"
        stderr = err.read_text()
        # Lightning's own exit codes: 0 after SIGTERM (SIGTERMException), 1 after Ctrl-C
        assert code == (0 if sig == signal.SIGTERM else 1), stderr[-3000:]
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-3000:]
        assert stopped < 45, f"the swarm took {stopped:.0f} s to stop"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


_SWALLOWED_CTRL_C = r"""
import os, signal, sys, weakref
from lightning_swarm.strategy import SwarmStrategy
from lightning_swarm.swarm.lifetime import latch_interrupts

if sys.argv[1] == "latched":
    latch_interrupts()


class Garbage:
    pass


def callback(ref):  # a weakref callback, run by the garbage collector wherever the main thread is
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives now: KeyboardInterrupt is raised in here
    for _ in range(100_000):
        pass


obj = Garbage()
ref = weakref.ref(obj, callback)
del obj
print("carried on", flush=True)
strategy = SwarmStrategy(num_stages=2)
for attempt in range(2):
    try:
        strategy._stop_requested()  # what the peer polls before every stage call and while it waits
        print("not raised", flush=True)
    except KeyboardInterrupt as e:
        print("raised", flush=True)
        strategy.on_exception(e)  # Lightning hands the interrupt to the strategy: it is not raised twice
"""


def test_a_ctrl_c_swallowed_by_a_weakref_callback_is_raised_at_the_next_stage_call(tmp_path):
    """Real SIGINT: Python swallows a KeyboardInterrupt raised in a weakref callback ("Exception ignored", and the
    program carries on). Latched (what ``SwarmStrategy`` does), the peer's next poll raises it, once, and the
    swallowed one is not reported as an error."""
    script = tmp_path / "swallowed.py"
    script.write_text(_SWALLOWED_CTRL_C)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {
        mode: subprocess.Popen(
            [sys.executable, str(script), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # a shell starts background jobs (a CI run, say) with SIGINT ignored; Python then keeps it ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        for mode in ("plain", "latched")
    }
    (plain_out, plain_err), (latched_out, latched_err) = (
        runs[m].communicate(timeout=120) for m in ("plain", "latched")
    )
    assert plain_out.split() == ["carried", "on", "not", "raised", "not", "raised"], plain_err[-2000:]
    assert "Exception ignored" in plain_err and "KeyboardInterrupt" in plain_err
    assert latched_out.split() == ["carried", "on", "raised", "not", "raised"], latched_err[-2000:]
    assert "Exception ignored" not in latched_err and "Traceback" not in latched_err, latched_err


_NEW_SESSION_SCRIPT = r"""
import os, subprocess, sys
from lightning_swarm.swarm.lifetime import die_with_parent
die_with_parent()  # what a peer's process does: a fork hook that places forked helpers
child = subprocess.Popen(
    [sys.executable, "-c", "import os; print(os.getsid(0), os.getpid())"],
    start_new_session=True, preexec_fn=lambda: None, stdout=subprocess.PIPE, text=True,
)
sid, pid = child.communicate(timeout=60)[0].split()
print("new session" if sid == pid else f"session {sid} of pid {pid}")
"""


def test_a_popen_asking_for_a_new_session_in_a_peers_process_gets_it() -> None:
    """A peer's fork hook (``die_with_parent``) put every forked child in its own process group, which made the
    ``setsid`` of ``Popen(start_new_session=True, preexec_fn=...)`` fail with EPERM in any process that had
    started a peer (seen in the test suite's workers); such a child now gets its session."""
    res = subprocess.run(
        [sys.executable, "-c", _NEW_SESSION_SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "new session", res.stdout


_UNCLOSED_STREAM = textwrap.dedent(
    """
    import asyncio, gc, sys
    from lightning_swarm.swarm.lifetime import latch_interrupts
    latch_interrupts()

    class LostTransport(asyncio.Transport):  # what CPython 3.11 meets once a connection is lost: _loop is None
        def is_closing(self):
            return False
        def close(self):
            pass
        def __repr__(self):
            return repr(None._selector)

    class Broken:
        def __del__(self):
            raise ValueError("a real unraisable error")

    loop = asyncio.new_event_loop()
    writer = asyncio.StreamWriter(LostTransport(), asyncio.Protocol(), None, loop)
    del writer
    gc.collect()
    broken = Broken()
    del broken
    gc.collect()
    print("done", flush=True)
    """
)


def test_asyncios_failure_to_describe_a_lost_stream_is_not_printed_but_other_unraisables_are() -> None:
    """A peer whose p2p daemon died once printed a traceback from CPython 3.11's ``StreamWriter.__del__`` (its
    ResourceWarning reads the lost transport's ``_loop._selector``); a peer's unraisable hook drops exactly that
    one and prints every other."""
    proc = subprocess.run(
        [sys.executable, "-c", _UNCLOSED_STREAM], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert "_selector" not in proc.stderr, proc.stderr
    assert "a real unraisable error" in proc.stderr, proc.stderr
