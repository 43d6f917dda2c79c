"""Train the tiny Transformer LM, e.g. in a local swarm of 4 peers:

python examples/lm/train.py fit --config examples/lm/configs/swarm.yaml
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_swarm  # noqa: E402,F401  (registers "swarm")
from examples.lm.data import PydocTextDataModule  # noqa: E402
from examples.lm.model import TinyTransformerLM  # noqa: E402


def main() -> None:
    LightningCLI(TinyTransformerLM, PydocTextDataModule)


if __name__ == "__main__":
    main()
