"""The figures table of ``docs/benchmarks.md``, regenerated from the reports that exist.

The table lies between the markers ``BEGIN`` and ``END``. Its rows are of three kinds, told apart by an HTML comment
in the claim cell (invisible once rendered):

- ``<!-- bench:NAME -->``: a generated row. Rebuilt from ``runs/NAME/NAME.json`` (latest figure: the registry's
  keys; date, commit, command and load from the JSON) and ``registry.BENCHMARKS[NAME]`` (claim, target) when that
  file exists; left as it is when it does not (``runs/`` is not in git: a checkout without the run keeps the row);
- ``<!-- earlier:NAME -->``: a hand-written row of benchmark NAME whose figures come from an earlier run whose JSON
  was not kept (its figure cell says so); kept verbatim. The generated row of NAME, once a report exists, goes just
  before the first of these (as do the rows of reports registered ``beside`` NAME);
- any other row (tests, example runs): hand-written, kept verbatim.

A report whose name has no row yet is added at the end of the table. Nothing else in the document changes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .registry import BENCHMARKS, Claim
from .report import ROOT, RUNS

BEGIN = (
    "<!-- benchmark-table: begin (generated rows: scripts/benchmark_table.py; hand-written rows are kept) -->"
)
END = "<!-- benchmark-table: end -->"
GENERATED = re.compile(r"<!-- bench:([\w.-]+) -->")
EARLIER = re.compile(r"<!-- earlier:([\w.-]+) -->")


def _number(v: float) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"{v:,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def value(v: Any, depth: int = 0) -> str:
    """A JSON value, short: numbers to 4 significant digits, lists joined with `` / ``, dicts as ``k v``."""
    if v is None:
        return "null"
    if isinstance(v, (bool, int, float)):
        return _number(v)
    if isinstance(v, list):
        shown = [value(x, depth + 1) for x in v[:8]]
        return (
            ("[" if depth else "")
            + " / ".join(shown)
            + (" / ..." if len(v) > 8 else "")
            + ("]" if depth else "")
        )
    if isinstance(v, dict):
        items = [f"{k} {value(x, depth + 1)}" for k, x in list(v.items())[:8]]
        return "{" + ", ".join(items) + (", ..." if len(v) > 8 else "") + "}"
    return str(v)


def lookup(record: dict[str, Any], path: str) -> Any:
    """``record["a"]["b"]`` for ``"a.b"``; KeyError when absent."""
    node: Any = record
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def figure(record: dict[str, Any], claim: Claim) -> str:
    parts = []
    for i, key in enumerate(claim.figures):
        try:
            shown = value(lookup(record, key))
        except KeyError:
            continue
        parts.append(f"**`{key}` {shown}**" if i == 0 else f"`{key}` {shown}")
    before, after = record.get("loadavg_before"), record.get("loadavg_after")
    if before and after:
        parts.append(f"load average {before[0]} before, {after[0]} after")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def row(name: str, record: dict[str, Any], claim: Claim) -> str:
    date = str(record.get("date", ""))
    date = date[:16].replace("T", " ") + " UTC" if date else "not recorded"
    commit = str(record.get("commit", "unknown"))
    commit = f"`{commit[:7]}`" + (" + uncommitted changes" if record.get("commit_dirty") else "")
    command = f"`{record.get('command', '?')}`" + (" (root)" if claim.root else "")
    cells = [
        f"{claim.claim} <!-- bench:{name} -->",
        claim.target,
        figure(record, claim),
        date,
        commit,
        command,
        f"`runs/{name}/{name}.json`",
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def reports(runs: Path) -> dict[str, dict[str, Any]]:
    """The reports of the registered benchmarks that exist under ``runs``."""
    found = {}
    for name in BENCHMARKS:
        path = runs / name / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def rebuild(lines: list[str], found: dict[str, dict[str, Any]]) -> list[str]:
    """The table's rows (header and separator included) with the generated rows rebuilt from ``found``."""
    out, emitted = [], set()
    for line in lines:
        generated, earlier = GENERATED.search(line), EARLIER.search(line)
        if generated:
            name = generated.group(1)
            if name in emitted:
                continue
            emitted.add(name)
            out.append(
                row(name, found[name], BENCHMARKS[name]) if name in found and name in BENCHMARKS else line
            )
            continue
        if earlier:  # the reports of this benchmark (and of those beside it) not shown yet go above its rows
            for name in found:
                if name not in emitted and earlier.group(1) in (name, BENCHMARKS[name].beside):
                    emitted.add(name)
                    out.append(row(name, found[name], BENCHMARKS[name]))
        out.append(line)
    out += [row(name, record, BENCHMARKS[name]) for name, record in found.items() if name not in emitted]
    return out


def update(doc: str, found: dict[str, dict[str, Any]]) -> str:
    lines = doc.split("\n")
    try:
        begin, end = lines.index(BEGIN), lines.index(END)
    except ValueError as e:
        raise SystemExit(f"the document has no table between {BEGIN!r} and {END!r}") from e
    table = [line for line in lines[begin + 1 : end] if line.strip()]
    return "\n".join([*lines[: begin + 1], *rebuild(table, found), *lines[end:]])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Regenerate the figures table of docs/benchmarks.md from runs/.")
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--runs", default=str(RUNS), help="where the reports are (runs/<name>/<name>.json)")
    p.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the table is not up to date"
    )
    args = p.parse_args(argv)
    doc = Path(args.doc)
    found = reports(Path(args.runs))
    old = doc.read_text()
    new = update(old, found)
    if args.check:
        sys.exit(0 if new == old else 1)
    if new != old:
        doc.write_text(new)
    print(f"{doc}: {len(found)} generated rows from {args.runs} ({', '.join(found) or 'no reports'})")
