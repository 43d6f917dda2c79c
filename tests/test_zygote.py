"""The tests' zygote (``tests/_zygote.py``): a job it forks sees what a freshly started one would, and its exit
status reaches the caller as a real child's does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests import _zygote
from tests._helpers import alive

JOB = """
import json, os, sys, time
mode = sys.argv[1]
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("ZYGOTE_TEST_X"),
                  "path0": sys.path[0], "stdin": sys.stdin.readline().strip(), "sid": os.getsid(0) == os.getpid()}))
print("to stderr", file=sys.stderr)
if mode == "raise":
    raise ValueError("boom")
if mode == "sleep":
    time.sleep(60)
sys.exit(int(mode))
"""


def test_a_forked_job_gets_its_arguments_directory_environment_streams_and_exit_status(tmp_path) -> None:
    import json

    script = tmp_path / "job.py"
    script.write_text(JOB)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "ZYGOTE_TEST_X": "42"}
    proc = _zygote.Popen(
        [sys.executable, str(script), "3"], cwd=work, env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc._zygote_conn is not None, "the job was not forked by the zygote"
    out, err = proc.communicate("hello\n", timeout=60)
    assert proc.returncode == 3
    seen = json.loads(out)
    assert seen == {"argv": [str(script), "3"], "cwd": str(work), "x": "42", "path0": str(tmp_path),
                    "stdin": "hello", "sid": False}  # fmt: skip
    assert err == "to stderr\n"

    failed = _zygote.run(
        [sys.executable, str(script), "raise"], input="", capture_output=True, text=True, timeout=60
    )
    assert failed.returncode == 1 and "ValueError: boom" in failed.stderr and "Traceback" in failed.stderr


def test_a_forked_job_in_its_own_session_is_killed_with_its_group(tmp_path) -> None:
    proc = _zygote.Popen(
        [sys.executable, "-m", "http.server", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )  # -m MODULE is forked too
    assert proc._zygote_conn is not None
    assert proc.wait(timeout=60) == 0
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = _zygote.Popen(
        [sys.executable, str(script), "sleep"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    assert proc._zygote_conn is not None
    time.sleep(1)
    assert proc.poll() is None and os.getpgid(proc.pid) == proc.pid
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_what_the_zygote_cannot_reproduce_starts_as_a_plain_process(tmp_path) -> None:
    proc = _zygote.Popen([sys.executable, "-c", "print(1)"], stdout=subprocess.PIPE, text=True)
    assert proc._zygote_conn is None and proc.communicate(timeout=60)[0] == "1\n"
    script = tmp_path / "omp.py"
    script.write_text("import os; print(os.environ['OMP_DYNAMIC'])")
    env = {**os.environ, "OMP_DYNAMIC": "true"}  # read when torch is imported: the zygote's would differ
    proc = _zygote.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc._zygote_conn is None and proc.communicate(timeout=60)[0] == "true\n"
    # a job's OMP_NUM_THREADS is applied in the forked child (a local swarm's launcher sets it for its peers)
    script.write_text("import os, torch; print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    proc = _zygote.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc._zygote_conn is not None and proc.communicate(timeout=60)[0] == "3 3\n"
    assert _zygote._ZYGOTE.usable_for([sys.executable, str(script)], {**os.environ, "PYTHONUNBUFFERED": "1"})


RANK_JOB = """
import os, sys, time
from lightning_swarm.strategy import launcher
from lightning_swarm.swarm.lifetime import set_parent_death_signal
child = sys.argv[1]
parent = os.getpid()
def start(code):
    return launcher.subprocess.Popen([sys.executable, child, code], env={**os.environ, "LOCAL_RANK": "1"},
                                     preexec_fn=lambda: set_parent_death_signal(parent_pid=parent))
done = start("7")
print("exit", done.wait(timeout=60), flush=True)
rank = start("sleep")
print("rank", rank.pid, type(rank).__name__, flush=True)
time.sleep(120)
"""

RANK = """
import os, sys, time
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


def test_the_ranks_of_a_forked_job_are_forked_too_and_end_with_the_job(tmp_path) -> None:
    """A job forked by the zygote starts its launcher's ranks through the zygote: the rank's exit status reaches
    the job, and a rank (whose parent is the zygote, not the job) is killed when the job is SIGKILLed."""
    job, rank = tmp_path / "job.py", tmp_path / "rank.py"
    job.write_text(RANK_JOB)
    rank.write_text(RANK)
    proc = _zygote.Popen([sys.executable, str(job), str(rank)], stdout=subprocess.PIPE, text=True)
    assert proc._zygote_conn is not None
    try:
        assert proc.stdout.readline().split() == ["exit", "7"]
        _, pid, kind = proc.stdout.readline().split()
        pid = int(pid)
        assert kind == "_RankPopen"
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) != proc.pid  # its parent is the zygote
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        assert not alive(pid), "a forked rank outlived its job"
    finally:
        if proc.poll() is None:
            proc.kill()


LOCK_JOB = """
import sys, time
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture, SharedBytes
locks = [MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock, _AsyncContextWrapper.EXECUTOR_LOCK]
if sys.argv[1] == "hold":
    for lock in locks:
        lock.acquire()
    print("held", flush=True)
    time.sleep(60)
else:
    print(all(lock.acquire(timeout=5) for lock in locks), flush=True)
"""


def test_a_job_killed_while_holding_hivemind_locks_blocks_no_other_job(tmp_path) -> None:
    """hivemind makes its process-shared locks (``MPFuture``'s, ``SharedBytes``', the process-wide executor's) when
    it is imported, in the zygote: every forked job gets locks of its own, as a fresh process does, so one
    SIGKILLed while holding them (a peer killed mid-call) does not block the next job's futures for good."""
    script = tmp_path / "locks.py"
    script.write_text(LOCK_JOB)
    holder = _zygote.Popen([sys.executable, str(script), "hold"], stdout=subprocess.PIPE, text=True)
    assert holder._zygote_conn is not None
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(timeout=30)
    other = _zygote.run([sys.executable, str(script), "take"], capture_output=True, text=True, timeout=60)
    assert other.returncode == 0 and other.stdout.strip() == "True", (other.stdout, other.stderr[-2000:])
