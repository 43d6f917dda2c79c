"""Generate docs/benchmarks.md from the benchmark reports in runs/<name>/<name>.json.

    python scripts/benchmark_table.py [--check] [--runs runs] [--doc docs/benchmarks.md]

Every row comes from a report (claim, target and figures' keys from benchmarks/_harness/registry.py, the rest from
the JSON); a benchmark without a report says so. ``--check`` changes nothing and exits 1 when the document differs.
See benchmarks/_harness/table.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _harness.table import main  # noqa: E402

if __name__ == "__main__":
    main()
