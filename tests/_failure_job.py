"""A local swarm that fails, run by ``tests/test_failures.py`` as a real multi-process program.

``python tests/_failure_job.py '<json>'``: every peer process re-runs this script (Lightning's launcher). Each peer
writes its pid tree to ``out/pids<rank>`` once training runs and, when ``fit`` ends, ``out/end<rank>``: a JSON line
with the wall-clock time, and the type (with its bases) and message of the exception ``fit`` raised, if any.

``cfg["fail"]``: ``{"where": "block", "rank": r}``: a block of the last stage raises ``ValueError("user bug 4711")``
in its forward on peer ``r`` (it serves that stage); ``{"where": "step", "rank": r, "step": s}``: peer ``r``'s
``training_step`` raises ``TypeError`` at step ``s``. The first raise writes ``out/raised``. ``cfg["kill_helper"]``:
``{"rank": r, "step": s, "helper": path}``: peer ``r`` SIGKILLs a helper process at step ``s``: its DHT's (default),
the averager at ``path`` from its ``SwarmPeer`` (e.g. ``"server.optimizer.grad_averager"``), or, with ``"p2pd"``, its
p2p daemon; with ``"during": method``, while the helper runs the method next (e.g. ``"sum_in_named_group"``:
mid-round). A helper that is a thread (a progress tracker, ``"server.optimizer.tracker"``) cannot be killed: its loop
is made to end.
"""

import faulthandler
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from torch import nn  # noqa: E402

import lightning_swarm  # noqa: E402
from tests.swarm_job import SeqModel, _descendants, regression_data  # noqa: E402

RANK = int(os.environ.get("LOCAL_RANK", "0"))


def _note_raise(out: str) -> None:
    try:  # the first raise of the run; "x": fails if another raise was first
        with open(os.path.join(out, "raised"), "x") as f:
            f.write(repr(time.time()))
    except FileExistsError:
        pass


class Buggy(nn.Module):
    """A block whose forward raises on one peer: a bug in the user's code that only that peer's data hits."""

    def __init__(self, out: str, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.out, self.rank = out, rank

    def forward(self, x):
        if RANK == self.rank:
            _note_raise(self.out)
            raise ValueError("user bug 4711")
        return self.lin(x)


class FailingModel(SeqModel):
    def __init__(self, cfg: dict) -> None:
        super().__init__(lr=0.05)
        self.cfg = cfg
        fail = cfg.get("fail") or {}
        if fail.get("where") == "block":
            self.layers[-1] = Buggy(cfg["out"], fail["rank"])

    def training_step(self, batch, batch_idx):
        fail = self.cfg.get("fail") or {}
        if fail.get("where") == "step" and RANK == fail["rank"] and self.global_step == fail["step"]:
            _note_raise(self.cfg["out"])
            raise TypeError(f"user bug in training_step at step {self.global_step}")
        return super().training_step(batch, batch_idx)


class Watch(Callback):
    """Writes this peer's process tree once training runs; SIGKILLs the DHT's helper process when asked."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.presence = None

    def on_train_start(self, trainer, pl_module):
        self.presence = trainer.strategy.peer.presence
        pids = [os.getpid(), *_descendants(os.getpid())]
        with open(os.path.join(self.cfg["out"], f"pids{RANK}"), "w") as f:
            f.write(" ".join(map(str, pids)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kill = self.cfg.get("kill_helper") or {}
        if RANK == kill.get("rank") and trainer.global_step == kill.get("step"):
            if kill.get("helper") == "p2pd":  # the p2p daemon that this peer's DHT process started
                dht = trainer.strategy.peer.dht
                daemons = [p for p in _descendants(dht.pid) if _is_p2pd(p)]
                assert len(daemons) == 1, daemons
                with open(os.path.join(self.cfg["out"], "helper"), "w") as f:
                    f.write(" ".join(map(str, daemons)))
                for pid in daemons:
                    os.kill(pid, signal.SIGKILL)
                return
            helper = trainer.strategy.peer
            for name in kill.get("helper", "dht").split("."):
                helper = getattr(helper, name)
            if (
                getattr(helper, "pid", None) is None
            ):  # a thread (a progress tracker) cannot be killed: it stops
                helper.shutdown_triggered.set()
                helper.should_report_progress.set()
                helper.global_state_updated.set()
                return
            with open(os.path.join(self.cfg["out"], "helper"), "w") as f:
                f.write(str(helper.pid))
            during = kill.get("during")
            if during is None:
                os.kill(helper.pid, signal.SIGKILL)
                return
            begin = getattr(helper, during)

            def kill_during(*args, **kwargs):  # the kill lands in the helper's next round, as it runs
                threading.Timer(0.05, os.kill, (helper.pid, signal.SIGKILL)).start()
                setattr(helper, during, begin)
                return begin(*args, **kwargs)

            setattr(helper, during, kill_during)


def _is_p2pd(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.basename(f.read().split(b"\0")[0]) == b"p2pd"
    except OSError:
        return False


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # a test that finds a peer hanging dumps its threads
    cfg = json.loads(sys.argv[1])
    seed_everything(0)
    watch = Watch(cfg)
    trainer = Trainer(
        strategy=lightning_swarm.SwarmStrategy(**cfg["strategy"]),
        accelerator="cpu",
        devices=cfg["devices"],
        max_steps=cfg["max_steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[watch],
    )
    end = {"rank": RANK, "error": None}
    try:
        trainer.fit(FailingModel(cfg), regression_data(n=cfg.get("samples", 64)))
    except BaseException as e:
        end["error"] = {"types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        raise
    finally:
        end["time"], end["steps"] = time.time(), trainer.global_step
        end["seen"] = getattr(watch.presence, "failure_seen_at", None)  # when it read another peer's failure
        with open(os.path.join(cfg["out"], f"end{RANK}"), "w") as f:
            f.write(json.dumps(end))


if __name__ == "__main__":
    main()
