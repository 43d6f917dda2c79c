"""The ALBERT example: data (bundled corpus, locally trained tokenizer, text files from a path), the model's
parameter sharing, the LightningCLI configs, and the main job's launcher end to end (a real local swarm)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from examples.albert.data import IGNORE, MASK, AlbertDataModule
from examples.albert.model import Albert
from tests import _zygote

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "albert" / "configs"
TINY_MODEL = {"embedding_size": 16, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64}


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the data module tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_bundled_corpus_and_tokenizer_build_offline_and_deterministically(tmp_path, no_network):
    dms = []
    for name in ("a", "b"):
        dm = AlbertDataModule(
            vocab_size=800, seq_len=32, train_samples=64, val_samples=16, cache_dir=tmp_path / name
        )
        dm.setup()
        dms.append(dm)
    a, b = dms
    assert (
        a.tokenizer.get_vocab() == b.tokenizer.get_vocab()
    )  # trained twice from scratch: the same vocabulary
    assert a.tokenizer.get_vocab_size() == 800
    for i in (0, 5, 63):
        torch.testing.assert_close(a.train_set[i], b.train_set[i])
    torch.testing.assert_close(a.val_set[3], b.val_set[3])
    cached = list((tmp_path / "a").glob("wordpiece-v2-800-*.json"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    again = AlbertDataModule(
        vocab_size=800, seq_len=32, train_samples=64, val_samples=16, cache_dir=tmp_path / "a"
    )
    again.setup()
    assert cached[0].stat().st_mtime_ns == mtime  # loaded from the cache, not retrained
    inputs, labels = a.train_set[0]
    assert inputs.shape == labels.shape == (32,)
    chosen = labels != IGNORE
    assert chosen.any() and (inputs[chosen] == MASK).any()
    assert (inputs[~chosen] != MASK).all()  # only chosen positions are masked
    text = a.tokenizer.decode(a.train_set.ids[:200].tolist())
    assert "python" in text.lower() or "the" in text.lower()


def _write_words(path: Path, words: list[str], repeat: int = 60) -> None:
    path.write_text("\n\n".join(" ".join(words[i:] + words[:i]) for i in range(repeat)), encoding="utf-8")


def test_reads_text_files_and_wikitext_from_a_path(tmp_path):
    train_words = "zebra quantum lantern meadow harbor violin copper falcon".split()
    valid_words = "orchid glacier tundra saffron".split()
    folder = tmp_path / "texts"
    folder.mkdir()
    _write_words(folder / "one.txt", train_words)
    _write_words(folder / "two.txt", train_words[::-1])
    dm = AlbertDataModule(
        data_dir=str(folder),
        vocab_size=120,
        seq_len=16,
        train_samples=8,
        val_samples=4,
        cache_dir=tmp_path / "c",
    )
    dm.setup()
    decoded = dm.tokenizer.decode(dm.train_set.ids[:100].tolist())
    assert set(decoded.split()) <= set(train_words)
    assert "zebra" in decoded

    wiki = tmp_path / "wikitext-103"
    wiki.mkdir()
    _write_words(wiki / "wiki.train.raw", train_words)
    _write_words(wiki / "wiki.valid.raw", valid_words)
    dm = AlbertDataModule(
        data_dir=str(wiki),
        vocab_size=120,
        seq_len=16,
        train_samples=8,
        val_samples=4,
        cache_dir=tmp_path / "c",
    )
    dm.setup()
    held_out = dm.tokenizer.decode(dm.val_set.ids.tolist())
    # the held-out text is wiki.valid.raw (its words were never in the tokenizer's training text: pieces of them)
    assert not set(held_out.split()) & set(train_words)
    assert set(dm.tokenizer.decode(dm.train_set.ids.tolist()).split()) <= set(train_words)

    with pytest.raises(FileNotFoundError, match="not a directory"):
        AlbertDataModule(data_dir=str(tmp_path / "missing")).setup()


def _count(vocab, e, h, groups, i, seq, boundary_extra=0):
    block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    embeddings = vocab * e + seq * e + 2 * e + (e * h + h)
    head = 2 * h + (h * e + e) + 2 * e + vocab  # final norm, dense, norm, output bias (decoder tied)
    return embeddings + groups * block + head + boundary_extra


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_albert_shares_layers_within_a_group_and_ties_the_head(groups):
    kw = {"vocab_size": 300, "seq_len": 16, "num_groups": groups, **TINY_MODEL}
    counts = []
    for layers in (1, 4):
        model = Albert(layers_per_group=layers, **kw)
        counts.append(sum(p.numel() for p in model.parameters()))
    # applying a group's block 4 times instead of once adds no parameter: they are shared
    assert counts[0] == counts[1] == _count(300, 16, 32, groups, 64, 16)
    model = Albert(layers_per_group=2, **kw)
    assert len(model.layers) == groups
    assert [p.shape for p in model.parameters()].count(torch.Size([300, 16])) == 1  # one [vocab, E] matrix
    # the head decodes with the word embeddings: a label id absent from the input still gets a gradient there
    inputs = torch.full((2, 16), 7)
    labels = torch.full((2, 16), IGNORE)
    labels[:, 3] = 123
    model.mlm_loss((inputs, labels)).backward()
    assert model.word_embeddings.weight.grad[123].abs().sum() > 0


def test_albert_boundaries_are_an_option():
    kw = {"vocab_size": 300, "seq_len": 16, "num_groups": 2, **TINY_MODEL}
    h, f = 32, 4
    base = _count(300, 16, 32, 2, 64, 16)
    maxout_pair = 2 * h + (h * h + h) + (h // f * h + h)  # compress (LayerNorm + linear) and expand (linear)
    bottleneck_pair = 2 * h + (h * h // f + h // f) + (h // f * h + h)
    ids = torch.zeros(2, 16, dtype=torch.long)
    # between the two groups only
    maxout = Albert(boundary="maxout", boundary_factor=f, boundary_ends=False, **kw)
    bottleneck = Albert(boundary="bottleneck", boundary_factor=f, boundary_ends=False, **kw)
    assert sum(p.numel() for p in maxout.parameters()) == base + maxout_pair
    assert sum(p.numel() for p in bottleneck.parameters()) == base + bottleneck_pair
    x = maxout.embedding_projection(maxout.embedding_norm(maxout.word_embeddings(ids)))
    assert maxout.layers[0](x).shape[-1] == h // f  # what crosses to the next stage
    assert maxout(ids).shape[-1] == h
    # the default: the trainer's hops shrink too (its input to the first group, the last group's output)
    maxout = Albert(boundary="maxout", boundary_factor=f, **kw)
    assert sum(p.numel() for p in maxout.parameters()) == base + 3 * maxout_pair
    x = maxout.boundary_in(maxout.embedding_projection(maxout.embedding_norm(maxout.word_embeddings(ids))))
    assert x.shape[-1] == h // f
    for group in maxout.layers:
        x = group(x)
        assert x.shape[-1] == h // f
    assert maxout(ids).shape[-1] == h


def _cli(args: list[str]):
    from examples.albert.train import AlbertCLI

    return AlbertCLI(Albert, AlbertDataModule, run=False, save_config_callback=None, args=args)


def test_configs_parse_and_agree():
    import lightning_swarm

    for name in ("swarm.yaml", "peer.yaml"):
        cli = _cli(["--config", str(CONFIGS / name), "--data.cache_dir=/tmp/lightning_swarm_test_tok"])
        strategy = cli.trainer.strategy
        assert isinstance(strategy, lightning_swarm.SwarmStrategy)
        s = strategy.settings
        assert s.num_stages == cli.model.hparams.num_groups == 2
        assert s.compression == "8bit"
        assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size  # linked arguments
    single = yaml.safe_load((CONFIGS / "single.yaml").read_text())
    peer = yaml.safe_load((CONFIGS / "peer.yaml").read_text())
    assert single["model"] == peer["model"] and single["data"] == peer["data"]
    # the baseline's global batch equals the swarm's target batch
    target = peer["trainer"]["strategy"]["init_args"]["target_batch_size"]
    assert single["data"]["batch_size"] * single["trainer"]["accumulate_grad_batches"] == target


def test_single_process_config_trains_a_few_steps(tmp_path):
    history = tmp_path / "single.json"
    callbacks = json.dumps(
        [{"class_path": "examples.albert.callbacks.TrainingHistory", "init_args": {"path": str(history)}}]
    )
    cmd = [
        sys.executable,
        "examples/albert/train.py",
        "fit",
        "--config",
        str(CONFIGS / "single.yaml"),
        "--trainer.max_steps=6",
        "--trainer.accumulate_grad_batches=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.callbacks={callbacks}",
        "--trainer.limit_val_batches=0",
        "--data.vocab_size=600",
        f"--data.cache_dir={tmp_path}",
        "--data.train_samples=512",
        "--model.lr=0.005",
        *[f"--model.{k}={v}" for k, v in TINY_MODEL.items()],
    ]
    proc = _zygote.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(history.read_text())
    assert record["done"] and record["step"] == [1, 2, 3, 4, 5, 6]
    assert record["loss"][-1] < record["loss"][0]
    assert 0 < record["eval_loss"] < 10


def test_main_job_launcher_survives_a_killed_peer_and_summarizes(tmp_path):
    """run_swarm.py end to end: 2 stages x 2 peers, the first of which also trains; a server-only peer of the last
    stage is killed (SIGKILL) at half of the steps and replaced, and the run still ends with the single-process
    baseline, the summary and the plot; no tracebacks or ERROR lines in its output."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "examples/albert/run_swarm.py", "--steps", "4", "--kill-peer-halfway", "--out", str(out),
        "--run-id", f"albert_test_{os.getpid()}", "--", "--data.vocab_size=600", f"--data.cache_dir={tmp_path}",
        "--trainer.strategy.init_args.target_batch_size=64", "--trainer.accumulate_grad_batches=2",
        "--trainer.limit_val_batches=0", *[f"--model.{k}={v}" for k, v in TINY_MODEL.items()],
    ]  # fmt: skip
    proc = _zygote.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "ERROR" not in output, output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["samples"] == 4 * 64
    assert "killed server-s1-0" in summary["events"][0], summary["events"]
    # a replacement that came up after this short run's trainer had finished waits for trainers and is stopped
    assert all("did not leave on its own" in e for e in summary["events"][1:]), summary["events"]
    assert "server-s1-replacement" in summary["events"][0]
    assert (out / "logs" / "server-s1-replacement.log").exists()
    assert summary["wire_bytes"] > 0
    assert summary["wire_bytes"] < 0.3 * summary["fp32_wire_bytes"]  # 8-bit boundaries: about 1/4 of fp32
    assert summary["eval_loss_swarm"] > 0 and summary["eval_loss_single"] > 0
    assert "held-out MLM loss" in proc.stdout and "single process" in proc.stdout
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_peers_end_with_a_killed_launcher(tmp_path):
    """A peer that the launcher starts (in its own session, out of reach of the launcher's Ctrl-C) still ends when
    the launcher is SIGKILLed: nothing is left running."""
    script = (
        "import os, sys, time\n"
        "from examples.albert.run_swarm import Peer\n"
        "peer = Peer('p', [sys.executable, '-c', 'import time; time.sleep(120)'], dict(os.environ), None)\n"
        "print(peer.proc.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(launcher.stdout.readline())
        os.kill(child, 0)  # running
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the peer outlived its launcher"
    finally:
        launcher.kill()
        if child is not None and _alive(child):  # the test failed: no sleeper left behind
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
