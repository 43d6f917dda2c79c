"""What a split backward costs in compute: one stage's input-gradient pass (B) and parameter-gradient pass (W)
against its whole backward, in one thread.

The stage is the one of ``swarm_vs_alternatives.py``: 4 ``nn.TransformerEncoderLayer`` of width 1024 (16 heads,
FFN 4096, pre-norm, dropout 0), a microbatch of 2 x 16 tokens. Each round runs a forward, then either
``torch.autograd.grad`` of the inputs and parameters (``whole``) or ``split_backward`` followed by every
``WeightWork.run_group`` (``split``: ``lightning_swarm/swarm/server/weight_grads.py``), alternating, with the
thread's CPU time of each part; the medians over the rounds are reported, and the largest difference between the
two ways' gradients. ``b_fraction``: B's share of the whole backward, the part a split stage's previous stage
waits for; ``overhead``: (B + W) / whole - 1, the graph walk's cost.

Usage: ``python benchmarks/split_backward.py [--quick]`` (``--quick``: 8 rounds instead of 30; a few seconds).
The last stdout line is JSON, also written to ``runs/split_backward/split_backward.json``.
"""

from __future__ import annotations

import statistics
import time

import _harness
import torch
from torch import nn

from lightning_swarm.swarm.server.weight_grads import split_backward


def main() -> None:
    parser = _harness.parser("split_backward", __doc__.split("\n\n")[0], quick="8 rounds instead of 30")
    args = parser.parse_args()
    report = _harness.Report("split_backward", args.out)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, layers, rows, seq = 1024, 4, 2, 16
    stage = nn.Sequential(
        *(
            nn.TransformerEncoderLayer(width, 16, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
    )
    params = list(stage.parameters())
    rounds = 8 if args.quick else 30
    times: dict[str, list[float]] = {"forward": [], "whole": [], "b": [], "w": []}
    worst = 0.0
    for i in range(rounds + 2):  # two warm-up rounds
        x = torch.randn(rows, seq, width, requires_grad=True)
        g = torch.randn(rows, seq, width)
        results = {}
        for way in ("whole", "split") if i % 2 else ("split", "whole"):
            start = time.thread_time()
            y = stage(x)
            forward = time.thread_time() - start
            if way == "whole":
                start = time.thread_time()
                results[way] = list(torch.autograd.grad([y], [x, *params], [g]))
                spent = {"whole": time.thread_time() - start}
            else:
                start = time.thread_time()
                split = split_backward([y], [g], [x], params)
                assert split is not None, "this stage's backward should split"
                b = time.thread_time() - start
                start = time.thread_time()
                inputs_grads, work = split
                while work.run_group():
                    pass
                spent = {"b": b, "w": time.thread_time() - start}
                results[way] = [*inputs_grads, *work.grads]
            if i >= 2:
                times["forward"].append(forward)
                for key, value in spent.items():
                    times[key].append(value)
        worst = max(worst, *(float((a - b).abs().max()) for a, b in zip(*results.values(), strict=True)))
    ms = {key: round(1e3 * statistics.median(values), 1) for key, values in times.items()}
    report.finish(
        {
            "forward_ms": ms["forward"],
            "whole_backward_ms": ms["whole"],
            "b_ms": ms["b"],
            "w_ms": ms["w"],
            "b_fraction": round(ms["b"] / ms["whole"], 3),
            "overhead": round((ms["b"] + ms["w"]) / ms["whole"] - 1, 3),
            "max_abs_grad_difference": worst,
            "rounds": rounds,
            "stage": f"{layers} x TransformerEncoderLayer({width}, 16 heads, FFN {4 * width}), {rows} x {seq} tokens",
        }
    )


if __name__ == "__main__":
    main()
