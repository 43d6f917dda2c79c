"""Run the code blocks of a Markdown page as a reader would: what tests/test_docs_commands.py checks.

A page's fenced blocks in ``bash``/``sh``/``shell`` and ``python`` are commands; the others (``text``, ``yaml``, no
language) are shown, not run. The runnable blocks of a page run in order, as one reader's terminal session:

- A shell block runs in ``bash -e`` from the repository root; the variables it exports reach the later blocks.
- A Python block is a complete script: it runs as a file of its own (``python block.py``) in an empty directory
  (the logs and checkpoints it writes go there).
- An HTML comment right before a block changes how it runs:
  - ``<!-- docs-test: skip: REASON -->``: not run (an illustration, a fragment, or something a named test runs);
    the reason is required.
  - ``<!-- docs-test: background until "TEXT" -->``: a long-lived process (a server): started, and the session goes
    on once its output holds TEXT; at the end it gets SIGINT, as from Ctrl-C, and must exit with 0.
- Every block must exit with 0 (``timeout_s`` at most) and print no traceback and no ERROR line, and nothing it
  started may be left running at the end.

What a reader changes for this machine, the runner changes too: a server listens on ``127.0.0.1`` at a free port
instead of the public ``0.0.0.0:31337``, and the example address of the first peer is replaced by the address that
the first background block printed (``Peers can join with: ADDRESS``), which is what the reader pastes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL = ("bash", "sh", "shell")
EXAMPLE_ADDRESS = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."
LOCAL = {"/ip4/0.0.0.0/tcp/31337": "/ip4/127.0.0.1/tcp/0"}
_ADDRESS = re.compile(r"Peers can join with: (\S+)")
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->", re.S)
_FENCE = re.compile(r"^(`{3,})(\S*)\s*$")
_BAD_LINE = re.compile(r"Traceback \(most recent call last\)|^\S*ERROR\b|\] ERROR\b|\bERROR:", re.M)


class DocBlockError(AssertionError):
    """A block of a page did not run as written."""


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    directive: str | None = None

    @property
    def runnable(self) -> bool:
        return self.language in (*SHELL, "python")

    @property
    def skip_reason(self) -> str | None:
        if self.directive is None or not self.directive.startswith("skip"):
            return None
        reason = self.directive[len("skip") :].lstrip(":").strip()
        if not reason:
            raise DocBlockError(f"{self.where}: 'docs-test: skip' needs a reason ('skip: why it is not run')")
        return reason

    @property
    def ready_text(self) -> str | None:
        """For a background block: the text its output holds once it is ready."""
        if self.directive is None or not self.directive.startswith("background"):
            return None
        match = re.fullmatch(r'background until "(.+)"', self.directive)
        if match is None:
            raise DocBlockError(
                f"{self.where}: write 'docs-test: background until \"TEXT\"', got {self.directive!r}"
            )
        return match.group(1)

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def parse(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the ``docs-test`` directive of the comment right before it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    pending: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            found = _DIRECTIVE.search(line)
            if found is not None:
                pending = found.group(1)
            elif line.strip():
                pending = None  # a directive belongs to the block right after it
            i += 1
            continue
        start, ticks = i, fence.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise DocBlockError(f"{path.name}:{start + 1}: a code block is not closed")
        blocks.append(Block(path, start + 1, fence.group(2).lower(), "\n".join(body) + "\n", pending))
        pending = None
        i += 1
    for block in blocks:  # malformed directives fail early, before anything runs
        if block.directive is not None and not block.directive.startswith(("skip", "background")):
            raise DocBlockError(f"{block.where}: unknown directive 'docs-test: {block.directive}'")
        block.skip_reason, block.ready_text  # noqa: B018  (raise on a malformed one)
    return blocks


@dataclass
class Output:
    """A process's merged stdout and stderr, line by line, with the time each line arrived."""

    lines: list[tuple[float, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str) -> float | None:
        """When the first line that matches ``pattern`` arrived (``time.monotonic()``)."""
        return next((t for t, line in self.lines if re.search(pattern, line)), None)


def _as_in_a_terminal() -> None:
    """Ctrl-C reaches a terminal's job even when this test runs under a parent that ignores SIGINT (a job started in
    the background by a shell without job control): a shell cannot trap a signal ignored when it started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Run:
    block: Block
    proc: subprocess.Popen
    output: Output
    started: float
    ended: float | None = None
    _reader: threading.Thread | None = None


class Session:
    """One reader's terminal: runs a page's blocks in order (see the module docstring)."""

    def __init__(self, timeout_s: float = 300.0, settle_s: float = 20.0) -> None:
        self.timeout_s, self.settle_s = timeout_s, settle_s
        self._tmp = tempfile.TemporaryDirectory(prefix="docs-test-")
        self.env = self._environment(Path(self._tmp.name) / "path")
        self.runs: list[Run] = []
        self.background: list[Run] = []
        self.substitutions = dict(LOCAL)

    @staticmethod
    def _environment(packages: Path) -> dict[str, str]:
        """The environment after the quick start's setup: the project's Python first on PATH, and this tree's
        ``lightning_swarm`` importable, without the repository root itself on the path (so that a command that
        needs it there fails here as it would for a reader)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LIGHTNING_SWARM_TEST"))}
        env.pop("PYTHONPATH", None)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        packages.mkdir()
        (packages / "lightning_swarm").symlink_to(ROOT / "lightning_swarm")
        env["PYTHONPATH"] = str(packages)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def code_of(self, block: Block) -> str:
        code = block.code
        for old, new in self.substitutions.items():
            code = code.replace(old, new)
        return code

    def _start(self, block: Block) -> Run:
        code = self.code_of(block)
        if block.language == "python":
            where = Path(tempfile.mkdtemp(dir=self._tmp.name, prefix=f"block{block.line}-"))
            (where / "block.py").write_text(code)
            cmd, cwd = [sys.executable, "block.py"], where
        else:
            env_file = Path(self._tmp.name) / f"env-{block.line}"
            cmd = ["bash", "-e", "-c", f"{code}\nenv -0 > {env_file}"]
            if block.ready_text is not None:
                cmd = ["bash", "-e", "-c", code]
            cwd = ROOT
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's job; what it leaves is found by it
            preexec_fn=_as_in_a_terminal,
        )
        run = Run(block, proc, Output(), time.monotonic())

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                run.output.lines.append((time.monotonic(), line))

        run._reader = threading.Thread(target=read, daemon=True)
        run._reader.start()
        self.runs.append(run)
        return run

    def run(self, block: Block) -> Run | None:
        """Run ``block`` (in the background if it says so); raise :class:`DocBlockError` if it fails."""
        if not block.runnable or block.skip_reason is not None:
            return None
        run = self._start(block)
        if block.ready_text is not None:
            self.background.append(run)
            deadline = time.monotonic() + self.timeout_s
            while block.ready_text not in run.output.text:
                if run.proc.poll() is not None:
                    run._reader.join(timeout=5)
                    self._fail(
                        run, f"exited with {run.proc.returncode} before it printed {block.ready_text!r}"
                    )
                if time.monotonic() > deadline:
                    self._fail(run, f"did not print {block.ready_text!r} within {self.timeout_s:.0f} s")
                time.sleep(0.1)
            address = _ADDRESS.search(run.output.text)
            if address is not None and EXAMPLE_ADDRESS not in self.substitutions:
                self.substitutions[EXAMPLE_ADDRESS] = address.group(1)
            self._check_output(run)
            return run
        try:
            run.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._fail(run, f"did not finish within {self.timeout_s:.0f} s")
        run.ended = time.monotonic()
        run._reader.join(timeout=3)  # the rest of its output (a process it left behind may hold the pipe)
        if run.proc.returncode != 0:
            self._fail(run, f"exited with {run.proc.returncode}")
        self._check_output(run)
        env_file = Path(self._tmp.name) / f"env-{block.line}"
        if block.language in SHELL and env_file.exists():  # what it exported reaches the next blocks
            entries = env_file.read_text().split("\0")
            self.env = dict(entry.split("=", 1) for entry in entries if "=" in entry)
            env_file.unlink()
        return run

    def stop(self) -> None:
        """Ctrl-C to every background block; each must exit with 0, and nothing that a block started may remain."""
        sessions = {run.proc.pid for run in self.runs}
        try:
            for run in self.background:
                if run.proc.poll() is None:
                    os.killpg(run.proc.pid, signal.SIGINT)
            for run in self.background:
                try:
                    run.proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    self._fail(run, "was still running 90 s after Ctrl-C (SIGINT)")
                run._reader.join(timeout=10)
                if run.proc.returncode != 0:
                    self._fail(run, f"exited with {run.proc.returncode} after Ctrl-C (SIGINT)")
                self._check_output(run)
            deadline = time.monotonic() + self.settle_s  # helpers (p2p daemons) end just after their peer
            while _members(sessions) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = _members(sessions)
            if left:
                raise DocBlockError(f"processes started by the blocks were left running: {left}")
        finally:
            self.kill()

    def kill(self) -> None:
        """Stop whatever the blocks started (after a failure), and remove the session's files."""
        sessions = {run.proc.pid for run in self.runs}
        for pid, _ in _members(sessions):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for run in self.runs:
            if run.proc.poll() is None:
                run.proc.wait(timeout=10)
        self._tmp.cleanup()

    def _check_output(self, run: Run) -> None:
        bad = _BAD_LINE.search(run.output.text)
        if bad is not None:
            self._fail(run, f"printed {bad.group(0)!r}")

    def _fail(self, run: Run, what: str) -> None:
        tail = run.output.text[-4000:]
        code = self.code_of(run.block)
        raise DocBlockError(
            f"{run.block.where}: the {run.block.language} block\n{code}{what}. Its output ended:\n{tail}"
        )


def _members(sessions: set[int]) -> list[tuple[int, str]]:
    """The live processes of the given sessions (a block's processes keep its session, in any process group)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if fields[0] != "Z" and int(fields[3]) in sessions:
            found.append((int(entry), cmdline))
    return found


def run_page(
    path: Path,
    timeout_s: float = 300.0,
    before_stop: Callable[[Session], None] | None = None,
    settle_s: float = 20.0,
) -> Session:
    """Run every runnable block of ``path`` in one session, then ``before_stop`` (more checks while the background
    blocks still run), then stop the background blocks. Raises :class:`DocBlockError` on the first failure."""
    blocks = parse(path)
    session = Session(timeout_s, settle_s)
    try:
        for block in blocks:
            session.run(block)
        if before_stop is not None:
            before_stop(session)
        session.stop()
    except BaseException:
        session.kill()
        raise
    return session
