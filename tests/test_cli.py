"""The ``lightning-swarm`` command: server-only peers started by hand join each other by ``--initial-peers``,
``status`` lists them, and a trainer-side client joining the same way runs the served stages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hivemind
import pytest
import torch
import yaml

from examples.albert.model import Albert
from lightning_swarm.swarm import SwarmClient, SwarmSettings
from tests import _zygote
from tests._helpers import alive, descendants

ROOT = Path(__file__).resolve().parents[1]
MODEL = {
    "vocab_size": 300,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_groups": 4,
    "layers_per_group": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "seq_len": 16,
}


def _start_server(
    config: Path, run_id: str, stage: int, initial_peers: list[str]
) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "lightning_swarm.cli", "serve", "examples.albert.model.Albert"]
    cmd += ["--config", str(config), "--run-id", run_id, "--num-stages", "2", "--stage", str(stage)]
    cmd += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--initial-peers", *initial_peers]
    proc = _zygote.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("Serving stage"):
            assert f"Serving stage {stage} of run {run_id!r}" in line
            return proc, line.rsplit(": ", 1)[1].split()[0]
    proc.kill()
    raise AssertionError(
        f"`lightning-swarm serve` for stage {stage} did not come up (exit code {proc.poll()})"
    )


@pytest.mark.timeout(300)
def test_serve_and_status_form_a_swarm_by_initial_peers(tmp_path: Path) -> None:
    run_id = f"cli-{os.getpid()}"
    config = tmp_path / "swarm.yaml"
    strategy = {"pipeline": "layers", "num_stages": 2, "compression": "none", "target_batch_size": 8}
    config.write_text(
        yaml.safe_dump(
            {
                "seed_everything": 0,
                "model": MODEL,
                "trainer": {
                    "strategy": {"class_path": "lightning_swarm.SwarmStrategy", "init_args": strategy}
                },
            }
        )
    )
    servers: list[subprocess.Popen] = []
    dht = None
    client = None
    try:
        first, address = _start_server(config, run_id, 0, [])
        servers.append(first)
        second, _ = _start_server(config, run_id, 1, [address])  # joins the first by its address only
        servers.append(second)

        status = _zygote.run(
            [sys.executable, "-m", "lightning_swarm.cli", "status", "--initial-peers", address]
            + ["--run-id", run_id],  # the number of stages comes from the peers' records
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr[-2000:]
        out = status.stdout
        assert f"run {run_id!r}: 2 stages, 2 peers (2 online)" in out and "bottleneck: stage" in out, out
        rows = [line.split() for line in out.splitlines()]
        assert [r[:3] for r in rows if len(r) >= 4 and r[0] in "01" and r[1] == "1"] == [
            ["0", "1", "1"],
            ["1", "1", "1"],
        ], out
        assert sorted(r[:2] for r in rows if len(r) == 7 and r[1] == "online") == [
            ["0", "online"],
            ["1", "online"],
        ]
        # no call served yet: the throughputs are the servers' guesses, and the table says so
        assert "(not measured yet)" in out and all(
            r[3] == "estimate" for r in rows if r[1:2] == ["online"]
        ), out

        # a trainer elsewhere joins by the same address and runs both served stages
        dht = hivemind.DHT(start=True, initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = SwarmClient(dht, SwarmSettings(run_id=run_id, num_stages=2, compression="none"))
        torch.manual_seed(0)
        reference = Albert(**MODEL)  # the servers built theirs from the same seed
        x = torch.randn(2, 16, MODEL["hidden_size"])
        with torch.no_grad():
            y = client.call_stage(1, client.call_stage(0, x))
            expected = x
            for block in reference.layers:
                expected = block(expected)
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=0)
        client.shutdown()
        client = None
        # a server killed outright (preemption, the OOM killer) takes its helper processes along: its DHT
        # process, the p2p daemon and the stage's averagers
        helpers = descendants(second.pid)
        assert len(helpers) >= 3, helpers
        second.kill()
        second.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(p) for p in helpers):
            time.sleep(0.2)
        assert not [p for p in helpers if alive(p)], "helpers of a SIGKILLed `lightning-swarm serve` lived on"
    finally:
        if client is not None:
            client.shutdown()
        if dht is not None:
            dht.shutdown()
        for proc in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in servers]
    assert codes == [0, -signal.SIGKILL]  # SIGTERM shuts a server down cleanly


def test_serve_finds_a_module_under_the_current_directory_as_python_m_does(tmp_path, monkeypatch) -> None:
    from lightning_swarm.cli import _load_class

    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "__init__.py").write_text("")
    (tmp_path / "my_models" / "net.py").write_text("class Net:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert _load_class("my_models.net.Net").__name__ == "Net"
    with pytest.raises(
        SystemExit, match="Run this command from the directory that holds the package 'nowhere'"
    ):
        _load_class("nowhere.net.Net")
