#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# the engine's contracts first (seconds): types (pyproject.toml's [tool.mypy]); the import rule is tests/test_architecture.py
python -m mypy
# 3 workers on the 2-core box: most integration tests wait on DHTs, sleeps and timeouts as much as they compute;
# the longest modules go first (tests/conftest.py). Extra arguments are pytest's (e.g. -m unit, -n 0).
python -m pytest -q -n 3 --dist worksteal "$@"
