"""Regenerate the figures table of docs/benchmarks.md from the benchmark reports in runs/<name>/<name>.json.

    python scripts/benchmark_table.py [--check] [--runs runs] [--doc docs/benchmarks.md]

Rows of benchmarks with a report are rebuilt (claim and target from benchmarks/_harness/registry.py, the rest from
the JSON); hand-written rows (tests, example runs, earlier runs whose JSON was not kept) stay as they are. See
benchmarks/_harness/table.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _harness.table import main  # noqa: E402

if __name__ == "__main__":
    main()
