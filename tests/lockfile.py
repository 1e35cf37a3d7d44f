"""The locked environments (requirements/lock.txt; lock-py312.txt for the Python 3.12 stack) read back: its pins, and how they meet pyproject's ranges.

``python -m tests.lockfile LOCK FREEZE`` prints what an environment (``pip list --format=freeze``) has that
differs from the lock; ``make test-latest`` uses it to say what the newest releases changed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
LOCK_PY312 = ROOT / "requirements" / "lock-py312.txt"
"""The second stack's lock (``make test-py312``): Python 3.12, the newest megatron-core, torch from PyPI."""
LOCKS = {(3, 11): LOCK, (3, 12): LOCK_PY312}
LOCK_IN = ROOT / "requirements" / "lock.in"


def lock_for(version: tuple[int, int]) -> Path | None:
    """The lock of the stack on this Python (``sys.version_info[:2]``), or None when none is locked for it."""
    return LOCKS.get(version)
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def pins(text: str) -> dict[str, Version]:
    """``name==version`` lines of a lock or a freeze, by canonical name."""
    found: dict[str, Version] = {}
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            found[canonicalize_name(m.group(1))] = Version(m.group(2))
    return found


def hashed(text: str) -> dict[str, int]:
    """How many ``--hash`` options follow each pin of a lock."""
    counts: dict[str, int] = {}
    name = ""
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            name = canonicalize_name(m.group(1))
            counts[name] = 0
        elif name and line.strip().startswith("--hash=sha256:"):
            counts[name] += 1
    return counts


def requirements() -> list[Requirement]:
    """What the lock must satisfy: pyproject's dependencies, its dev extra and lock.in's own lines."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    lines += [ln.split("#")[0].strip() for ln in LOCK_IN.read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln]


def unmet(locked: dict[str, Version]) -> list[str]:
    """Each requirement the locked versions do not satisfy, as a sentence."""
    problems = []
    for req in requirements():
        have = locked.get(canonicalize_name(req.name))
        if have is None:
            problems.append(f"{req}: not in the lock")
        elif not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req}: the lock has {have}")
    return problems


def diff(locked: dict[str, Version], other: dict[str, Version]) -> list[str]:
    """One line per package whose version differs between the lock and another environment."""
    lines = []
    for name in sorted(set(locked) | set(other)):
        a, b = locked.get(name), other.get(name)
        if a != b:
            lines.append(f"  {name}: lock {a or '-'} -> {b or '-'}")
    return lines


def main(argv: list[str]) -> int:
    lock, freeze = (Path(a).read_text() for a in argv)
    changed = diff(pins(lock), pins(freeze))
    print("newest versions vs the lock:" if changed else "newest versions are the locked ones")
    print("\n".join(changed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
