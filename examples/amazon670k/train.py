"""Train the extreme-classification example with LightningCLI.

    python examples/amazon670k/train.py fit --config examples/amazon670k/configs/small.yaml
    python examples/amazon670k/train.py fit --config examples/amazon670k/configs/full.yaml
    python examples/amazon670k/train.py fit --config examples/amazon670k/configs/small.yaml --model.output dense

The model's ``num_features``/``num_labels`` come from the data module (the files' header for
real data), so they are never set twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from anywhere: make the repository root importable so `examples.amazon670k` resolves.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402

import lightning_swarm  # noqa: E402,F401  (registers the "swarm"/"dslide" strategies)
from examples.amazon670k.data import XCDataModule  # noqa: E402
from examples.amazon670k.model import XCModel  # noqa: E402


class XCLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_features", "model.num_features", apply_on="instantiate")
        parser.link_arguments("data.num_labels", "model.num_labels", apply_on="instantiate")


def main(args: list[str] | None = None) -> LightningCLI:
    return XCLightningCLI(XCModel, XCDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
