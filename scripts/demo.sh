#!/usr/bin/env bash
# Set up (if needed) and run the main job: a local swarm of 4 peer processes training a small Transformer LM on
# the documentation text bundled with CPython. Extra arguments go to the LightningCLI (e.g. --trainer.max_steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/lm/train.py fit --config examples/lm/configs/swarm.yaml "$@"
