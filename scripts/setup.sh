#!/usr/bin/env bash
# Create .venv (if missing) and install the project with torch==2.13.0: the CPU build (any other torch request pulls
# a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# one pip call, one resolver pass; torch==2.13.0 is the CPU build on disk
python -m pip install -q torch==2.13.0 -e ".[test]"
# iptables for the test bed's NAT (skipped with a message without root or apt-get)
bash scripts/system_deps.sh
