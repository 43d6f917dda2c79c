"""The benchmarks' common command line: every benchmark takes ``--quick`` and ``--out``."""

from __future__ import annotations

import argparse


def parser(name: str, description: str | None, quick: str, raw: bool = False) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for benchmark ``name`` with ``--quick`` (its help: ``quick``, what the quick run
    changes) and ``--out`` (the folder of the report, ``runs/<name>/`` by default); ``raw``: keep the
    description's line breaks (a whole docstring)."""
    p = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument(
        "--out",
        default=None,
        help=f"folder for the JSON report (and the plot); default runs/{name}/ (a variant's name where the "
        "options make one, e.g. runs/swarm_hop_1000mbit/)",
    )
    return p
