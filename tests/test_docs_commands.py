"""Every command in README.md and docs/ runs as written (see tests/_doc_blocks.py for how a page's blocks run).

README's blocks run as one reader would run them from the repository root: the D-SLIDE and SWARM scripts, the
several-machines flow on 127.0.0.1 (two ``lightning-swarm serve`` peers, a trainer of 10 steps, ``status``) and the
command line's help. While its servers still run, a second trainer joins them; then Ctrl-C ends the servers.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests._doc_blocks import EXAMPLE_ADDRESS, ROOT, DocBlockError, Session, parse, run_page

pytestmark = pytest.mark.integration

DOC_PAGES = sorted((ROOT / "docs").rglob("*.md"))
LAST_STEP = r"`max_steps=10` reached"


def _trainer_left_in_time(run, limit_s: float = 30.0) -> float:
    """Seconds from the trainer's last step to its exit, checked against ``limit_s``."""
    last_step = run.output.first(LAST_STEP)
    assert last_step is not None, run.output.text[-3000:]
    assert run.ended is not None and run.proc.returncode == 0
    waited = run.ended - last_step
    assert waited < limit_s, f"the trainer exited {waited:.1f} s after its last step"
    assert "still serving" not in run.output.text  # it serves nothing: it has nobody to wait for
    return waited


@pytest.mark.timeout(900)
def test_readme_runs_as_written_and_a_trainer_leaves_when_its_training_ends() -> None:
    figures: dict[str, float] = {}

    def second_trainer_joins(session: Session) -> None:
        trainer_runs = [run for run in session.runs if "train.py fit" in run.block.code]
        assert len(trainer_runs) == 1
        first = trainer_runs[0]
        figures["first"] = _trainer_left_in_time(first)
        status_runs = [run for run in session.runs if "lightning-swarm status --run-id" in run.block.code]
        assert len(status_runs) == 1
        out = status_runs[0].output.text
        assert re.search(r"2 stages, 2 peers \(2 online\)", out), out
        online = [row for row in (line.split() for line in out.splitlines()) if row[1:2] == ["online"]]
        assert len(online) == 2 and all(row[3] == "measured" for row in online), out  # the trainer's calls
        second = session.run(first.block)  # the servers serve on: a second trainer joins afterwards
        assert second is not None
        figures["second"] = _trainer_left_in_time(second)

    session = run_page(ROOT / "README.md", timeout_s=300, before_stop=second_trainer_joins)
    servers = session.background
    assert len(servers) == 2 and all(run.proc.returncode == 0 for run in servers)  # Ctrl-C: a clean exit
    assert EXAMPLE_ADDRESS in session.substitutions  # the flow used the first server's printed address
    print(f"trainers left {figures['first']:.1f} s and {figures['second']:.1f} s after their last step")


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.timeout(600)
def test_docs_pages_run_as_written(page: Path) -> None:
    run_page(page, timeout_s=300)


def test_readme_is_a_users_guide() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert not re.findall(r"\b[0-9a-f]{7,40}\b", text)  # no commit hashes
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)  # no dates
    assert [b.language for b in parse(ROOT / "README.md") if b.runnable and b.skip_reason is None].count(
        "python"
    ) == 2


_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # hex with a letter and a digit
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_ISSUE = re.compile(r"\bissues? \d+|(?<![\w&])#\d+\b", re.IGNORECASE)
# benchmarks.md is generated (its commit column comes from the reports); the table test holds a made-up report
_HISTORY_EXEMPT = ("docs/benchmarks.md", "tests/test_benchmark_table.py")


def test_docs_and_comments_name_no_commits_dates_or_issues() -> None:
    """Documents say what is true now: history is in git and in the benchmark reports, and the tracker is not in
    the repository."""
    files = [ROOT / "README.md", *DOC_PAGES]
    for folder in ("lightning_swarm", "tests", "examples", "benchmarks", "testbed", "scripts"):
        files += sorted((ROOT / folder).rglob("*.py"))
    found = []
    for path in files:
        name = str(path.relative_to(ROOT))
        if name.startswith(_HISTORY_EXEMPT):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in (_HASH, _DATE, _ISSUE):
                found += [f"{name}:{number}: {m.group(0)}" for m in pattern.finditer(line)]
    assert not found, "\n".join(found)


# ---- the runner itself, on small synthetic pages


def _page(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(body)
    return path


GOOD = """# A page

<!-- docs-test: background until "Peers can join with" -->
```bash
trap 'exit 0' INT
echo "Peers can join with: /ip4/127.0.0.1/tcp/1/p2p/QmExample"
while true; do sleep 0.1; done
```

```bash
export GREETING=hello
```

```bash
test "$GREETING" = hello  # what a block exports reaches the next ones
test "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..." = /ip4/127.0.0.1/tcp/1/p2p/QmExample
```

```python
import sys
assert sys.argv[0] == "block.py"
```

<!-- docs-test: skip: an illustration -->
```python
model = MyModel()
```

```text
shown, not run
```
"""


def test_the_runner_runs_a_page_as_written(tmp_path: Path) -> None:
    session = run_page(_page(tmp_path, GOOD), timeout_s=30)
    assert [run.block.line for run in session.runs] == [4, 10, 14, 19]
    assert session.background[0].proc.returncode == 0


@pytest.mark.parametrize(
    "change, error",
    [
        (
            ('test "$GREETING" = hello', 'test "$GREETING" = hullo'),
            r"page.md:14: the bash block.*exited with 1",
        ),
        (('assert sys.argv[0] == "block.py"', "import no_such_module"), r"page.md:19: .*exited with 1"),
        (("<!-- docs-test: skip: an illustration -->", ""), r"page.md:25: .*exited with 1"),
        (("<!-- docs-test: skip: an illustration -->", "<!-- docs-test: skip -->"), r"needs a reason"),
        (("trap 'exit 0' INT\n", ""), r"page.md:4: .*exited with -?\d+ after Ctrl-C"),
        (
            ('echo "Peers', 'echo "Peers" && exit 0 && echo "'),
            r"page.md:4: .*exited with 0 before it printed",
        ),
        (
            ("export GREETING=hello", "export GREETING=hello; sleep 300 &"),
            r"left running: \[\(\d+, 'sleep 300",
        ),
        (("export GREETING=hello", "export GREETING=hello; echo 'ERROR: it broke'"), r"printed 'ERROR"),
    ],
    ids=[
        "shell",
        "python",
        "illustration-unmarked",
        "skip-without-reason",
        "server-ctrl-c",
        "server-early",
        "left",
        "error-line",
    ],
)
def test_the_runner_fails_when_a_block_no_longer_runs(
    tmp_path: Path, change: tuple[str, str], error: str
) -> None:
    old, new = change
    assert old in GOOD
    start = time.monotonic()
    with pytest.raises(DocBlockError, match=re.compile(error, re.S)):
        run_page(_page(tmp_path, GOOD.replace(old, new)), timeout_s=30, settle_s=2)
    assert time.monotonic() - start < 60
