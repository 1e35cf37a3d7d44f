"""Every ``lifecycle ...`` command line that the README and docs/*.md show in a fenced code block works as shown.

Each line (after an optional ``$ `` prompt, with backslash continuations joined and a trailing ``# comment``
removed) must parse with the CLI's own argparse parser. The policy of each ``run``, ``validate`` and ``explain``
line — its config dir, config name and Hydra overrides — must then pass ``lifecycle validate`` (exit 0), and each
``diff`` line must compare two valid policies (exit 0 or 1). A line whose comment says ``# exits 2`` is an error
example: its validation must exit 2. Lines with a placeholder (``RUN_DIR``, ``N``, ``<...>``) are only parsed.
The commands run from the repository root (``examples/...`` paths resolve) with the example policy pack
installed in a temporary folder, as the docs install it before they use its presets.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lifecycle.cli import COMMANDS, build_parser
from tests.helpers import ROOT, install_team_pack, run_cli

DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELL_FENCES = {"bash", "sh", "shell", "console"}
SHELL_STOPS = {">", ">>", "<", "|", "||", "&&", ";", "&", "2>", "2>&1"}
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|^[A-Z][A-Z0-9_]*$")
EXITS_2 = re.compile(r"\bexits 2\b")
CHECKED = {"run", "validate", "explain"}


@dataclass(frozen=True)
class Command:
    """One command line of the docs: where it is, its arguments after ``lifecycle``, and its comment."""

    where: str
    args: tuple[str, ...]
    comment: str

    @property
    def placeholder(self) -> bool:
        return any(PLACEHOLDER.search(arg) for arg in self.args)

    @property
    def expected(self) -> int:
        return 2 if EXITS_2.search(self.comment) else 0


def _split_comment(line: str) -> tuple[str, str]:
    """(command, comment): a ``#`` outside quotes that starts a word begins the comment, as in the shell."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:]
    return line, ""


def _logical_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, in a shell block) for each line of a fenced block, continuations joined."""
    fence: str | None = None
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            pending = []
            continue
        if fence is None:
            continue
        text = raw.strip()
        if not pending:
            start = number
            text = text.removeprefix("$ ")
        if text.endswith("\\"):
            pending.append(text[:-1].strip())
            continue
        yield start, " ".join([*pending, text]), fence in SHELL_FENCES
        pending = []


def _commands() -> list[Command]:
    found = []
    for path in DOCS:
        for number, text, shell in _logical_lines(path):
            if not text.startswith("lifecycle "):
                continue
            command, comment = _split_comment(text)
            words = shlex.split(command)[1:]
            cut = next((i for i, w in enumerate(words) if w in SHELL_STOPS or w.startswith(">")), len(words))
            words = words[:cut]
            # outside shell blocks (console output, error text), only lines that name a subcommand are commands
            if shell or (words and (words[0] in COMMANDS or words[0].startswith("-"))):
                found.append(Command(f"{path.relative_to(ROOT)}:{number}", tuple(words), comment))
    return found


COMMAND_LINES = _commands()


def _parse(args: tuple[str, ...]) -> tuple[argparse.Namespace | None, str]:
    """The CLI parser's namespace for ``args`` and argparse's complaint ("" when it parsed)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return build_parser().parse_args(list(args)), ""
        except SystemExit:
            return None, err.getvalue().strip() or "argparse exited"


def _policy_args(ns: argparse.Namespace) -> tuple[str, ...]:
    """The ``validate`` arguments that name the same policy as a run/validate/explain line."""
    config_dir = ("--config-dir", ns.config_dir) if ns.config_dir else ()
    # a validate line's world size is part of what it checks (the plan's limits); explain only shows them
    world = ("--world-size", str(ns.world_size)) if ns.command == "validate" and ns.world_size else ()
    return (*world, *config_dir, "--config-name", ns.config_name, *ns.overrides)


def _checks() -> dict[tuple[str, ...], list[Command]]:
    """Subprocess checks, one per distinct argument list: ``validate ...`` or ``diff ...``."""
    checks: dict[tuple[str, ...], list[Command]] = {}
    for cmd in COMMAND_LINES:
        ns, _ = _parse(cmd.args)
        if ns is None or cmd.placeholder:
            continue
        if ns.command in CHECKED:
            key: tuple[str, ...] = ("validate", *_policy_args(ns))
        elif ns.command == "diff":
            key = tuple(a for a in cmd.args if a != "--json")
        else:
            continue
        checks.setdefault(key, []).append(cmd)
    return checks


CHECKS = _checks()


def test_the_docs_show_commands() -> None:
    assert len(COMMAND_LINES) >= 40, [c.where for c in COMMAND_LINES]
    shown = {c.args[0] for c in COMMAND_LINES}
    assert {"run", "validate", "explain", "diff", "timeline", "policies", "schema"} <= shown
    assert any(c.expected == 2 for c in COMMAND_LINES), "the docs show no error example (# exits 2)"


def test_every_command_line_parses() -> None:
    failures = [f"{c.where}: lifecycle {shlex.join(c.args)}\n  {why}"
                for c in COMMAND_LINES for why in [_parse(c.args)[1]] if why]
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def pack_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/team_pack installed into a folder of its own (see tests.helpers.install_team_pack)."""
    site = install_team_pack(tmp_path_factory.mktemp("pack"))
    return site


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", list(CHECKS), ids=[CHECKS[k][0].where for k in CHECKS])
def test_the_policy_of_each_command_line_is_valid(argv: tuple[str, ...], pack_site: Path) -> None:
    cmds = CHECKS[argv]
    proc = run_cli(*argv, timeout=60, env={"PYTHONPATH": str(pack_site)}, cwd=ROOT)
    expected = {cmd.expected for cmd in cmds}
    assert len(expected) == 1, f"{[c.where for c in cmds]}: the same policy is shown both as valid and as an error"
    allowed = {0, 1} if argv[0] == "diff" and expected == {0} else expected
    shown = "\n".join(f"{c.where}: lifecycle {shlex.join(c.args)}" for c in cmds)
    assert proc.returncode in allowed, (f"{shown}\nlifecycle {shlex.join(argv)} exited {proc.returncode}, expected "
                                        f"{sorted(allowed)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
