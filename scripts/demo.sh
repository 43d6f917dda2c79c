#!/usr/bin/env bash
# Set up (if needed) and run the main job: a local swarm (2 stages x 2 peers, separate processes; the first also trains)
# trains ALBERT on the documentation bundled with CPython, then the same model trains in one plain Lightning process
# for the same number of optimizer steps; prints a summary and writes runs/albert/loss.png.
# Extra arguments go to examples/albert/run_swarm.py, e.g. --kill-peer-halfway, or `-- --trainer.max_steps=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/albert/run_swarm.py "$@"
