"""Train ALBERT with the LightningCLI, in one process or as one peer of a swarm:

python examples/albert/train.py fit --config examples/albert/configs/single.yaml   # plain Lightning
python examples/albert/train.py fit --config examples/albert/configs/swarm.yaml    # 4 local peers (devices=4)
python examples/albert/train.py fit --config examples/albert/configs/peer.yaml     # one peer of a swarm anywhere

The main job (`scripts/demo.sh`) starts the peers with `examples/albert/run_swarm.py`.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_swarm  # noqa: E402,F401  (registers "swarm")
from examples.albert.data import AlbertDataModule  # noqa: E402
from examples.albert.model import Albert  # noqa: E402

# hivemind 1.1.12 logs these on healthy runs (a trainer's optimizer is built with hivemind's default request
# timeout, and its averager process may already be gone when it is shut down): not errors, so not shown
_BENIGN = ("Averager shutdown has no effect", "It is recommended to use request_timeout smaller")


class _DropBenignHivemindLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_BENIGN)


for _name in ("hivemind.averaging.averager", "hivemind.averaging.matchmaking"):
    logging.getLogger(_name).addFilter(_DropBenignHivemindLines())
if os.environ.get(
    "ALBERT_QUIET"
):  # set by run_swarm.py: only the progress bar and the results on the terminal
    for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed"):
        logging.getLogger(_name).setLevel(logging.WARNING)


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
