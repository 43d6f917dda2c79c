"""Train ALBERT with the LightningCLI, in one process or as one peer of a swarm:

python examples/albert/train.py fit --config examples/albert/configs/single.yaml   # plain Lightning
python examples/albert/train.py fit --config examples/albert/configs/swarm.yaml    # 4 local peers (devices=4)
python examples/albert/train.py fit --config examples/albert/configs/peer.yaml     # one peer of a swarm anywhere

The main job (`scripts/demo.sh`) starts the peers with `examples/albert/run_swarm.py`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_swarm  # noqa: E402,F401  (registers "swarm")
from examples.albert.data import AlbertDataModule  # noqa: E402
from examples.albert.model import Albert  # noqa: E402


class AlbertCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
        # one source of truth for sizes the model and the data must agree on
        parser.link_arguments("data.vocab_size", "model.vocab_size")
        parser.link_arguments("data.seq_len", "model.seq_len")


def main() -> None:
    # every peer of a swarm runs this: no config.yaml written to the working directory
    AlbertCLI(Albert, AlbertDataModule, save_config_callback=None)


if __name__ == "__main__":
    main()
