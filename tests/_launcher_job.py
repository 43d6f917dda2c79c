"""A local swarm's process tree without the swarm: what `tests/test_launcher.py` runs.

Usage: python tests/_launcher_job.py OUT_DIR MODE, MODE one of
- ``restart``: 3 peers, peer 1 SIGKILLs itself once and is restarted; peer 0 prints what the launcher saw.
- ``fail``: 3 peers, peer 1 exits with an error status (as a peer whose script raised); peer 0 prints what the
  launcher saw and the error it raises for it (not restarted, although ``restart_peers=1``).
- ``hold``: 3 peers; every peer forks a hivemind-like helper process, writes the pids and sleeps (the test
  SIGKILLs peer 0 and checks that nothing is left).
"""

import json
import multiprocessing as mp
import os
import signal
import sys
import time

from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_swarm.strategy.launcher import FAILED_CHILD_GRACE_S, RESTART_ENV, SwarmLauncher
from lightning_swarm.swarm.dht.presence import PeerFailure
from lightning_swarm.swarm.lifetime import die_with_parent


def _sleep() -> None:
    time.sleep(120)


def _raised(launcher: SwarmLauncher) -> str | None:
    try:
        launcher.raise_failed_child()
    except PeerFailure as e:
        return str(e)
    return None


def main(out: str, mode: str) -> None:
    launcher = SwarmLauncher(
        LightningEnvironment(), 3, 1, restart_peers=1, exit_timeout=60, poll_interval=0.2
    )

    def run() -> None:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        restarted = int(os.environ.get(RESTART_ENV, "0"))
        if mode == "restart":
            if rank == 1 and not restarted:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            open(os.path.join(out, f"peer{rank}.{restarted}"), "w").close()
            if rank == 0:
                # the replacement imports torch and Lightning first: minutes on a loaded 2-core box
                deadline = time.monotonic() + 240
                while not os.path.exists(os.path.join(out, "peer1.1")) and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(0.5)  # the observer polls every 0.2 s
                print(json.dumps({"deaths": launcher.deaths, "restarts": launcher.restarts}), flush=True)
        elif mode == "fail":
            if rank == 1:
                time.sleep(0.5)
                sys.exit(3)
            if rank == 0:
                deadline = time.monotonic() + 60
                while not launcher.deaths and time.monotonic() < deadline:
                    time.sleep(0.1)
                early = _raised(launcher)  # within the grace period: the DHT route has the error's message
                time.sleep(FAILED_CHILD_GRACE_S)
                seen = {"deaths": launcher.deaths, "restarts": launcher.restarts, "early": early}
                print(
                    json.dumps({**seen, "raised": _raised(launcher), "again": _raised(launcher)}), flush=True
                )
        else:
            die_with_parent()
            helper = mp.get_context("fork").Process(target=_sleep, daemon=True)
            helper.start()
            with open(os.path.join(out, f"pids{rank}.tmp"), "w") as f:
                f.write(f"{os.getpid()} {helper.pid}")
            os.replace(os.path.join(out, f"pids{rank}.tmp"), os.path.join(out, f"pids{rank}"))
            time.sleep(120)

    launcher.launch(run)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
