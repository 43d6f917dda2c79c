"""The report of a benchmark run: ``runs/<name>/<name>.json`` (and the plot, ``runs/<name>/<name>.png``), and the
same JSON object as the last stdout line.

``Report(name, out)`` is made when the run starts (it notes the load average, the command line, the commit and
the start time then); ``finish(figures)`` adds to the figures

- ``benchmark`` (the name), ``commit`` (``git rev-parse HEAD`` at the start; ``unknown`` outside a checkout) and
  ``commit_dirty`` (true when the working tree differed from it at the start or at the end, or HEAD moved during
  the run: the figures are not those of that commit; the table in ``docs/benchmarks.md`` marks such a report);
- ``date`` (UTC, ISO 8601, when the figures were done) and ``run_seconds``;
- ``loadavg_before`` and ``loadavg_after`` (1, 5 and 15 minutes: these boxes are shared);
- ``command`` (the command line, as it could be typed again from the repository root);

writes the whole object to ``<out>/<name>.json`` (``out``: ``runs/<name>`` under the repository root unless the
benchmark's ``--out`` says otherwise) and prints it as one line. ``scripts/benchmark_table.py`` builds the figures
table of ``docs/benchmarks.md`` from these files.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "runs"
META_KEYS = (
    "benchmark",
    "commit",
    "commit_dirty",
    "date",
    "run_seconds",
    "loadavg_before",
    "loadavg_after",
    "command",
)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_commit(root: Path = ROOT) -> tuple[str, bool | None]:
    """(HEAD's hash, whether the working tree differs from it); ("unknown", None) outside a git checkout.

    A change to a tracked file or a file git does not ignore makes the tree dirty; the reports under ``runs/`` do
    not (a run writes one, and the last run's may wait to be committed with the next)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        return git("rev-parse", "HEAD").strip(), bool(
            git("status", "--porcelain", "--", ".", ":(exclude)runs").strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def command_line(argv: list[str] | None = None) -> str:
    """``python <script relative to the repository root> <arguments>``, quoted for a shell."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        script_text = str(script.relative_to(ROOT))
    except ValueError:
        script_text = str(script)
    return shlex.join(["python", script_text, *argv[1:]])


class Report:
    def __init__(self, name: str, out: str | os.PathLike | None = None) -> None:
        self.name = name
        self.dir = Path(out) if out else RUNS / name
        self.loadavg_before = loadavg()
        self.command = command_line()
        self.commit, self.commit_dirty = git_commit()
        if self.commit_dirty:
            print(
                f"{name}: the working tree has uncommitted changes; the report will say so (commit_dirty: true) "
                "and docs/benchmarks.md will show it. Commit first for a figure anyone can reproduce.",
                file=sys.stderr,
                flush=True,
            )
        self._started = time.monotonic()

    def path(self, filename: str) -> Path:
        """``<out>/<filename>`` (the folder is created)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir / filename

    @property
    def json_path(self) -> Path:
        return self.dir / f"{self.name}.json"

    @property
    def png(self) -> Path:
        """Where the plot goes: ``<out>/<name>.png``."""
        return self.path(f"{self.name}.png")

    def finish(self, figures: dict[str, Any]) -> dict[str, Any]:
        """Write ``figures`` and the run's metadata to ``<out>/<name>.json``, print them as the last stdout line
        and return them."""
        commit, dirty_now = git_commit()  # code changed under the run, or HEAD moved, counts as well
        record = {
            **figures,
            "benchmark": self.name,
            "commit": self.commit,
            "commit_dirty": bool(self.commit_dirty or dirty_now or commit != self.commit)
            if self.commit_dirty is not None
            else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "run_seconds": round(time.monotonic() - self._started, 1),
            "loadavg_before": self.loadavg_before,
            "loadavg_after": loadavg(),
            "command": self.command,
        }
        self.path(f"{self.name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record), flush=True)
        return record
