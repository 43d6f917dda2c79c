"""The loss curves of a run (swarm trainers and the single-process baseline) as a PNG."""

from __future__ import annotations

from pathlib import Path


def smooth(values: list[float], window: int = 8) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_losses(curves: dict[str, dict], path: Path, events: list[str] | None = None) -> None:
    """Training loss (smoothed, per optimizer step) and validation loss of each run in ``curves`` (name ->
    ``TrainingHistory`` record), with the held-out loss at the end as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, h) in enumerate(curves.items()):
        color = f"C{i}"
        per_step: dict[int, list[float]] = {}
        for step, loss in zip(h["step"], h["loss"], strict=True):
            per_step.setdefault(step, []).append(loss)
        steps = sorted(per_step)
        losses = [sum(per_step[s]) / len(per_step[s]) for s in steps]
        ax.plot(steps, smooth(losses, 3), color=color, alpha=0.9, label=f"{name}: train (smoothed)")
        if h.get("val"):
            vs, vl = zip(*h["val"], strict=True)
            ax.plot(vs, vl, "o--", color=color, ms=3, alpha=0.7, label=f"{name}: validation")
        if h.get("eval_loss") is not None:
            ax.plot(
                [steps[-1]],
                [h["eval_loss"]],
                "*",
                color=color,
                ms=12,
                label=f"{name}: held-out {h['eval_loss']:.3f}",
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("masked-LM loss")
    ax.set_title(
        "ALBERT: swarm vs single process" + (f"  ({'; '.join(events)})" if events else ""), fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
