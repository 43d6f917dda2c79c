"""The extreme-classification example: repository-format reader/writer, synthetic generator,
batching, and end-to-end training through LightningCLI."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.amazon670k.data import (
    XCData,
    XCDataModule,
    collate_sparse,
    iter_xc_file,
    make_synthetic,
    popularity_p_at_1,
    read_header,
    read_xc_file,
    write_xc_file,
)
from examples.amazon670k.xc_format import _parse_lines, _read_xc_file_by_lines
from tests import _zygote

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "amazon670k" / "sample_data"


# ---------------------------------------------------------------------------------------------
# Reader / writer
# ---------------------------------------------------------------------------------------------


def test_sample_file_parses_to_known_values() -> None:
    points = list(iter_xc_file(SAMPLE_DIR / "train.txt"))
    assert points == [
        ([0, 3], [0, 2, 7], [0.5, 1.25, 0.1]),
        ([1], [1, 9], [1.0, 0.25]),
        ([], [3, 4], [0.75, 0.5]),  # line starting with a space: no labels
        ([2, 4], [0, 5], [1.0, 2.5]),
        ([4], [8], [0.125]),
        ([], [6], [1.5]),  # line starting directly with a feature: no labels
    ]
    assert read_header(SAMPLE_DIR / "train.txt") == (6, 10, 5)
    data = read_xc_file(SAMPLE_DIR / "train.txt")
    assert (len(data), data.num_features, data.num_labels) == (6, 10, 5)
    assert data.label_indptr.tolist() == [0, 2, 3, 3, 5, 6, 6]
    assert data.labels.tolist() == [0, 3, 1, 2, 4, 4]
    assert data.feature_indptr.tolist() == [0, 3, 5, 7, 9, 10, 11]
    assert data.feature_ids.tolist() == [0, 2, 7, 1, 9, 3, 4, 0, 5, 8, 6]
    np.testing.assert_array_equal(
        data.feature_values, np.float32([0.5, 1.25, 0.1, 1, 0.25, 0.75, 0.5, 1, 2.5, 0.125, 1.5])
    )


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("3 10\n0 1:1\n", 1, "bad header"),
        ("two 10 5\n0 1:1\n", 1, "bad header"),
        ("2 10 5\n0 1:1\n1 2-1\n", 3, "bad feature '2-1'"),
        ("2 10 5\n0 1:1\n1 2:x\n", 3, "bad feature '2:x'"),
        ("2 10 5\n0 1:1\n1 2:1 :3\n", 3, "bad feature ':3'"),
        ("2 10 5\n0 1:1\n1,5 2:1\n", 3, "label 5 out of range"),
        ("2 10 5\n0 1:1\n1,,2 2:1\n", 3, "bad label list"),
        ("2 10 5\n0 10:1\n1 2:1\n", 2, "feature 10 out of range"),
        ("2 10 5\n0 -1:1\n1 2:1\n", 2, "feature -1 out of range"),
        ("2 10 5\n0 1:1\n\n", 3, "empty line"),
        ("3 10 5\n0 1:1\n1 2:1\n", 4, "file ends after 2 points"),
        ("1 10 5\n0 1:1\n1 2:1\n", 3, "more points than"),
    ],
)
def test_malformed_input_names_file_and_line(tmp_path: Path, text: str, line: int, what: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_xc_file(path)
    assert f"bad.txt:{line}:" in str(err.value)
    assert what in str(err.value)


def test_writer_reader_round_trip(tmp_path: Path) -> None:
    data = make_synthetic(300, num_features=500, num_labels=200, seed=3)
    # Drop the labels of point 0: a point without labels must survive the round trip too.
    n0 = int(data.label_indptr[1])
    label_indptr = np.concatenate([[0], data.label_indptr[1:] - n0])
    data = XCData(
        label_indptr, data.labels[n0:], data.feature_indptr, data.feature_ids, data.feature_values, 500, 200
    )
    assert len(data.row(0)[0]) == 0
    path = tmp_path / "train.txt"
    write_xc_file(path, data)
    back = read_xc_file(path)
    for name in ("label_indptr", "labels", "feature_indptr", "feature_ids", "feature_values"):
        np.testing.assert_array_equal(getattr(back, name), getattr(data, name), err_msg=name)
    assert (back.num_features, back.num_labels) == (500, 200)


@pytest.mark.parametrize("corrupt", [False, True])
def test_vectorised_reader_equals_the_line_parser(tmp_path: Path, corrupt: bool) -> None:
    """Random files with every value syntax float() accepts here (exponents, signs, '.5', '5.', 20 digits, CRLF,
    lines without labels); with ``corrupt`` one character is inserted somewhere: same data or same error."""
    rng = random.Random(7)
    values = [
        lambda: str(rng.randint(0, 99)), lambda: f"{rng.random():.6f}", lambda: f"{rng.random() * 1e-7:.9g}",
        lambda: f"-{rng.random():.3e}", lambda: f".{rng.randint(0, 999)}", lambda: f"{rng.randint(1, 9)}.",
        lambda: f"{rng.random():.20f}", lambda: f"1e{rng.randint(-30, 30)}", lambda: f"+{rng.random():.4f}",
        lambda: f"{rng.random() * 1e30:.17g}",
    ]  # fmt: skip
    for trial in range(12):
        lines = []
        for _ in range(200):
            labels = [str(rng.randint(0, 49)) for _ in range(rng.randint(0, 3))]
            feats = [f"{rng.randint(0, 99)}:{rng.choice(values)()}" for _ in range(rng.randint(0, 6))] or [
                "1:1"
            ]
            lead = " " if not labels and rng.random() < 0.5 else ""
            gap = rng.choice([" ", "  "])
            lines.append(
                lead
                + ",".join(labels)
                + (gap if labels else "")
                + gap.join(feats)
                + rng.choice(["", " ", "\r"])
            )
        if corrupt:
            i = rng.randrange(len(lines))
            cut = rng.randrange(len(lines[i]) + 1)
            bad = rng.choice([":", ",", " ", "x", "-", ".", "e", "\t", "::", ", ", "99999"])
            lines[i] = lines[i][:cut] + bad + lines[i][cut:]
        path = tmp_path / f"t{trial}.txt"
        path.write_text(f"{len(lines)} 100 50\n" + "\n".join(lines) + rng.choice(["", "\n"]), newline="")
        outcomes = []
        for reader in (read_xc_file, _read_xc_file_by_lines):
            try:
                outcomes.append(reader(path))
            except ValueError as err:
                outcomes.append(str(err))
        if isinstance(outcomes[1], str):
            assert outcomes[0] == outcomes[1]
        else:
            assert _csr_equal(outcomes[0], outcomes[1]) and outcomes[0].feature_values.dtype == np.float32


def test_vectorised_reader_takes_the_fast_path_on_written_files(tmp_path: Path) -> None:
    data = make_synthetic(500, num_features=2000, num_labels=900, seed=4)
    path = tmp_path / "train.txt"
    write_xc_file(path, data)
    body = path.read_bytes().split(b"\n", 1)[1]
    parsed = _parse_lines(body, 2000, 900)
    assert parsed is not None and parsed.num_lines == 500  # no fallback: the vectorised parser did the work
    assert _csr_equal(read_xc_file(path), data)


# ---------------------------------------------------------------------------------------------
# Synthetic generator
# ---------------------------------------------------------------------------------------------


def _csr_equal(a: XCData, b: XCData) -> bool:
    names = ("label_indptr", "labels", "feature_indptr", "feature_ids", "feature_values")
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in names)


def test_synthetic_is_deterministic_in_the_seed() -> None:
    a = make_synthetic(2000, num_features=3000, num_labels=4000, seed=5)
    b = make_synthetic(2000, num_features=3000, num_labels=4000, seed=5)
    c = make_synthetic(2000, num_features=3000, num_labels=4000, seed=6)
    assert _csr_equal(a, b)
    assert not _csr_equal(a, c)


def test_synthetic_shape_and_validity() -> None:
    data = make_synthetic(3000, num_features=2000, num_labels=5000, seed=0)
    labels_per_point = np.diff(data.label_indptr)
    assert labels_per_point.min() >= 1 and labels_per_point.max() <= 5
    assert np.diff(data.feature_indptr).min() >= 1
    assert data.labels.min() >= 0 and data.labels.max() < 5000
    assert data.feature_ids.min() >= 0 and data.feature_ids.max() < 2000
    assert (data.feature_values > 0).all()
    rows = np.repeat(np.arange(len(data)), np.diff(data.feature_indptr))
    norms = np.sqrt(np.bincount(rows, weights=data.feature_values.astype(np.float64) ** 2))
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    for i in range(0, len(data), 97):  # ids within a point are sorted and distinct
        labels, ids, _ = data.row(i)
        assert (np.diff(labels) > 0).all() and (np.diff(ids) > 0).all()


def test_synthetic_label_frequencies_are_skewed() -> None:
    data = make_synthetic(20_000, num_features=20_000, num_labels=20_000, seed=0)
    counts = np.sort(np.bincount(data.labels, minlength=data.num_labels))[::-1]
    top_share = counts[: data.num_labels // 100].sum() / counts.sum()
    assert top_share > 0.3  # the top 1% of labels cover over 30% of occurrences (uniform: 1%)
    assert (counts == 0).sum() > 0.2 * data.num_labels  # a long tail never seen in 20k points


def test_synthetic_is_learnable_by_a_centroid_classifier() -> None:
    # Train/test from the same distribution: same structure seed, different point seeds.
    train = make_synthetic(4000, num_features=3000, num_labels=3000, seed=1, sample_seed=10)
    test = make_synthetic(500, num_features=3000, num_labels=3000, seed=1, sample_seed=11)

    def dense(d: XCData) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(len(d), d.num_features)
        x[torch.from_numpy(np.repeat(np.arange(len(d)), np.diff(d.feature_indptr))), d.feature_ids] = (
            torch.from_numpy(d.feature_values)
        )
        y = torch.zeros(len(d), d.num_labels)
        y[torch.from_numpy(np.repeat(np.arange(len(d)), np.diff(d.label_indptr))), d.labels] = 1.0
        return x, y

    x_train, y_train = dense(train)
    x_test, y_test = dense(test)
    centroids = torch.nn.functional.normalize(y_train.T @ x_train, dim=1)
    top1 = (x_test @ centroids.T).argmax(dim=1)
    p_at_1 = y_test[torch.arange(len(test)), top1].mean().item()
    chance = popularity_p_at_1(train, test)
    assert chance < 0.1
    assert p_at_1 > 0.5 and p_at_1 > 5 * chance


# ---------------------------------------------------------------------------------------------
# Batching and the DataModule
# ---------------------------------------------------------------------------------------------


def test_collate_builds_embedding_bag_inputs_and_padded_labels() -> None:
    data = read_xc_file(SAMPLE_DIR / "train.txt")
    indices, offsets, values, labels = collate_sparse([data.row(i) for i in (0, 2, 3)])
    assert indices.dtype == torch.long and offsets.dtype == torch.long and values.dtype == torch.float32
    assert indices.tolist() == [0, 2, 7, 3, 4, 0, 5]
    assert offsets.tolist() == [0, 3, 5]
    assert values.tolist() == pytest.approx([0.5, 1.25, 0.1, 0.75, 0.5, 1.0, 2.5])
    assert labels.tolist() == [[0, 3], [-1, -1], [2, 4]]
    _, _, _, only_empty = collate_sparse([data.row(2)])
    assert only_empty.tolist() == [[-1]]


def test_datamodule_reads_real_files_and_takes_shape_from_the_header() -> None:
    dm = XCDataModule(data_dir=str(SAMPLE_DIR), batch_size=4)
    assert (dm.num_features, dm.num_labels) == (10, 5)
    dm.setup("fit")
    assert len(dm.train_data) == 6 and len(dm.test_data) == 3
    seen = []
    for indices, offsets, values, labels in dm.train_dataloader():
        assert len(offsets) == labels.shape[0] and len(indices) == len(values)
        seen += [sorted(int(y) for y in row if y >= 0) for row in labels]
    assert sorted(seen) == sorted([[0, 3], [1], [], [2, 4], [4], []])
    with pytest.raises(ValueError, match="num_labels=7 but the files"):
        _ = XCDataModule(data_dir=str(SAMPLE_DIR), num_labels=7).num_labels
    with pytest.raises(FileNotFoundError, match="train_file"):
        _ = XCDataModule(data_dir=str(SAMPLE_DIR), train_file="trn.txt").num_labels


def test_datamodule_synthetic_shuffles_training_data() -> None:
    dm = XCDataModule(
        synthetic_samples=500, synthetic_test_samples=100, num_features=800, num_labels=600, batch_size=50
    )
    dm.setup("fit")
    assert (len(dm.train_data), len(dm.test_data)) == (500, 100)
    torch.manual_seed(0)
    first = next(iter(dm.train_dataloader()))[3]
    in_order = collate_sparse([dm.train_data.row(i) for i in range(50)])[3]
    assert first.shape[0] == 50 and not torch.equal(first, in_order)
    assert not _csr_equal(dm.train_data.select(slice(0, 100)), dm.test_data)


# ---------------------------------------------------------------------------------------------
# Model and training through LightningCLI
# ---------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
SMALL_CONFIG = REPO / "examples" / "amazon670k" / "configs" / "small.yaml"


def _cli(tmp_path: Path, *args: str):
    from examples.amazon670k.train import main

    common = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    common += ["--trainer.default_root_dir", str(tmp_path)]
    return main(["fit", "--config", str(SMALL_CONFIG), *common, *args])


def test_full_softmax_loss_equals_active_set_loss_over_all_labels() -> None:
    from examples.amazon670k.model import full_softmax_loss
    from lightning_swarm.layers import active_set_loss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen, requires_grad=True)
    labels = torch.tensor([[3, 7, -1], [0, -1, -1], [-1, -1, -1], [39, 1, 2], [5, -1, -1], [8, 9, -1]])
    ids = torch.arange(40).expand(6, -1)
    dense = full_softmax_loss(logits, labels)
    sparse = active_set_loss(ids, logits, labels)
    assert dense.item() == pytest.approx(sparse.item(), rel=1e-6)
    dense.backward()
    assert logits.grad[2].abs().sum() == 0  # the label-less row contributes nothing


@pytest.mark.parametrize("output", ["sparse", "dense"])
def test_cli_trains_and_p_at_1_is_clearly_above_chance(tmp_path: Path, output: str) -> None:
    size = ["--data.num_features", "2000", "--data.num_labels", "2000"]
    size += ["--data.synthetic_samples", "4000", "--data.synthetic_test_samples", "500"]
    cli = _cli(
        tmp_path,
        *size,
        "--model.output",
        output,
        "--model.num_active",
        "512",
        "--model.num_bits",
        "6",
        "--trainer.max_epochs",
        "3",
    )
    # The model's shape came from the data module through the CLI's argument links.
    assert cli.model.input_layer.in_features == 2000
    assert cli.model.output_layer.out_features == 2000
    layer_type = "SparseLSHLinear" if output == "sparse" else "Linear"
    assert type(cli.model.output_layer).__name__ == layer_type
    p_at_1 = float(cli.trainer.callback_metrics["val/p@1"])
    chance = popularity_p_at_1(cli.datamodule.train_data, cli.datamodule.test_data)
    assert p_at_1 > 0.3 and p_at_1 > 5 * chance, (p_at_1, chance)
    assert float(cli.trainer.callback_metrics["val/p@5"]) <= p_at_1


def test_cli_reads_real_format_files_with_fast_dev_run(tmp_path: Path) -> None:
    cli = _cli(
        tmp_path,
        "--data.data_dir",
        str(SAMPLE_DIR),
        "--data.num_features",
        "null",
        "--data.num_labels",
        "null",
        "--data.batch_size",
        "4",
        "--trainer.fast_dev_run",
        "2",
    )
    assert cli.model.input_layer.in_features == 10 and cli.model.output_layer.out_features == 5
    assert cli.model.output_layer.num_steps.item() == 2  # two training steps through the LSH layer
    assert "val/p@1" in cli.trainer.callback_metrics


@pytest.mark.timeout(180)
def test_train_script_runs_from_the_repository_root(tmp_path: Path) -> None:
    import sys

    cmd = [sys.executable, "examples/amazon670k/train.py", "fit", "--config", str(SMALL_CONFIG)]
    cmd += [
        "--data.synthetic_samples",
        "300",
        "--data.synthetic_test_samples",
        "100",
        "--trainer.fast_dev_run",
        "2",
    ]
    cmd += ["--trainer.default_root_dir", str(tmp_path)]
    result = _zygote.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fast_dev_run" in result.stdout + result.stderr


def test_model_rejects_an_unknown_output_kind() -> None:
    from examples.amazon670k.model import XCModel

    with pytest.raises(ValueError, match="output must be 'sparse' or 'dense'"):
        XCModel(num_features=10, num_labels=5, output="softmax")  # type: ignore[arg-type]


def test_model_reports_only_the_p_at_k_that_the_label_space_allows() -> None:
    from examples.amazon670k.model import XCModel

    model = XCModel(num_features=10, num_labels=3, output="sparse", num_active=3)
    model.configure_model()
    model.eval()
    batch = collate_sparse([(np.array([0, 2]), np.array([1, 4]), np.array([0.5, 1.0], np.float32))] * 2)
    model.validation_step(batch, 0)
    assert set(model.val_precision.compute()) == {"p@1", "p@3"}
