"""Policy YAML checked before OmegaConf (or anything else) builds it: bounded in bytes, depth and values.

A policy file is read as bytes up to a size limit (1 MiB, or :data:`MAX_BYTES_ENV`), decoded as UTF-8
(an error names the byte offset), and its YAML event stream is walked with a counter before any object is
built: nesting deeper than :data:`MAX_DEPTH` is refused, and an alias counts as the full size of the node
it repeats, so an alias bomb (a few hundred bytes that expand to millions of values) is refused after at
most :data:`MAX_VALUES` values of work. The counter is shared by every file of one compose.

Hydra reads every config file (the primary config, the built-ins, a user dir, packs) through
``FileConfigSource.load_config``; :func:`guard_hydra_files` wraps it for the duration of one compose (and
restores it after), so a hostile file is refused, naming its path, before OmegaConf parses it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from lifecycle.errors import PolicyError

MAX_BYTES_ENV = "LIFECYCLE_MAX_POLICY_BYTES"
DEFAULT_MAX_BYTES = 1 << 20
MAX_DEPTH = 32
"""Nesting levels of mappings and lists (a policy is about five deep)."""
MAX_VALUES = 5_000
"""Values (keys, scalars, lists, mappings) all files of one compose may expand to, aliases in full
(a real policy has a few hundred; OmegaConf builds about 20,000 a second)."""

MAX_INT_DIGITS = 4300
"""Python's limit for int(str) (sys.get_int_max_str_digits())."""

_FAST = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when PyYAML was built with it


class Budget:
    """The values left to one compose; every checked file spends from it."""

    def __init__(self, values: int = MAX_VALUES) -> None:
        self.limit = values
        self.used = 0


def max_bytes() -> int:
    """The size limit for one policy file: :data:`MAX_BYTES_ENV` when set, else 1 MiB."""
    raw = os.environ.get(MAX_BYTES_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_MAX_BYTES
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or int(text[:20]) < 1:
        raise PolicyError.single(MAX_BYTES_ENV, "must be a positive number of bytes (e.g. 4194304 for 4 MiB); "
                                 "fix or unset the environment variable", raw[:40])
    if len(text) > 12:  # a policy file is read whole: a limit past a terabyte is no limit
        raise PolicyError.single(MAX_BYTES_ENV, "is larger than 10^12 bytes; a policy file is read whole into "
                                 "memory: give a limit of a few MiB", raw[:40])
    return int(text)


def read_policy_text(path: str | Path) -> str:
    """The file's text: a regular file, at most :func:`max_bytes` long, valid UTF-8."""
    where, limit = str(path), max_bytes()
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as exc:
        raise _error(where, f"cannot open the policy file ({_reason(exc)}); check the path and its "
                     "permissions") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _error(where, "is not a regular file; a policy is a YAML file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise _error(where, f"cannot read the policy file ({_reason(exc)})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        size = max(len(data), os.path.getsize(path) if os.path.exists(path) else 0)
        raise PolicyError.single(where, f"policy file is larger than the limit of {limit} bytes; shrink it, or "
                                 f"raise the limit with {MAX_BYTES_ENV}=<bytes>", size)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _error(f"{where}:{line}", f"not UTF-8: byte 0x{data[exc.start]:02X} at byte offset {exc.start} "
                     f"cannot be decoded ({exc.reason}); save the file as UTF-8") from None


def check_yaml(text: str, where: str, budget: Budget | None = None) -> None:
    """Walk the YAML events of ``text``: refuse syntax errors, deep nesting and too many values."""
    budget = budget if budget is not None else Budget()
    anchors: dict[str, int] = {}
    open_nodes: list[tuple[int, str | None]] = []  # (budget.used when the collection began, its anchor)
    try:
        for event in yaml.parse(text, Loader=_FAST):
            if isinstance(event, yaml.AliasEvent):
                _spend(budget, anchors.get(event.anchor or "", 1), event, where)
            elif isinstance(event, yaml.ScalarEvent):
                _spend(budget, 1, event, where)
                _check_scalar(event, where)
                if event.anchor:
                    anchors[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                _spend(budget, 1, event, where)
                open_nodes.append((budget.used - 1, event.anchor))
                if len(open_nodes) > MAX_DEPTH:
                    raise _error(_at(where, event), f"nested deeper than {MAX_DEPTH} levels; a policy is a "
                                 "few levels deep: flatten the file")
            elif isinstance(event, yaml.CollectionEndEvent) and open_nodes:
                start, anchor = open_nodes.pop()
                if anchor:
                    anchors[anchor] = budget.used - start
    except yaml.YAMLError as exc:
        raise yaml_error(exc, where) from None


_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
"""YAML 1.1's base-60 numbers (``1:0`` is 60, ``1:30:00`` is 5400), which YAML 1.2 dropped: never what was meant."""


def _check_scalar(event: yaml.ScalarEvent, where: str) -> None:
    value = event.value
    if not event.style and len(value) > MAX_INT_DIGITS and value.lstrip("+-").isdigit():
        raise _error(_at(where, event), f"an integer of {len(value)} digits; Python reads at most "
                     f"{MAX_INT_DIGITS} from text: quote it if it is a string, else use a smaller number")
    if not event.style and _SEXAGESIMAL.match(value):
        raise _error(_at(where, event), f"{value!r} is a base-60 number in YAML 1.1 (the parser would read "
                     f"{_base60(value)}); write the number you mean, or quote it if it is a string")


def _base60(text: str) -> str:
    sign = -1 if text.startswith("-") else 1
    total = 0.0
    for part in text.lstrip("+-").replace("_", "").split(":"):
        total = total * 60 + float(part)
    return f"{sign * total:g}"


def _spend(budget: Budget, n: int, event: yaml.Event, where: str) -> None:
    budget.used += n
    if budget.used > budget.limit:
        raise _error(_at(where, event), f"the policy files expand to more than {budget.limit} values (an "
                     "alias counts in full each time it is used); a policy has a few hundred: remove the aliases "
                     "that repeat large nodes, or the bulk of the values")


def yaml_error(exc: yaml.YAMLError, where: str) -> PolicyError:
    """A PolicyError naming ``where:line:column`` and the parser's complaint."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).split("\n")[0]
    context = getattr(exc, "context", None)
    detail = f"{problem} ({context})" if context else problem
    at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    return _error(at, f"not valid YAML: {detail}; fix the file")


def check_file(path: str | Path, budget: Budget | None = None) -> str:
    """Read and check one policy file; its text (which is then safe to parse)."""
    text = read_policy_text(path)
    check_yaml(text, str(path), budget)
    return text


def parse(text: str, where: str) -> Any:
    """Build the data of a text :func:`check_yaml` accepted (a SafeLoader: libyaml's when available)."""
    try:
        return yaml.load(text, Loader=_FAST)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:  # an undefined or recursive alias: only building finds those
        raise yaml_error(exc, where) from None
    except (ValueError, RecursionError) as exc:  # an integer of more than 4300 digits
        raise _error(where, f"cannot build a value ({str(exc)[:200]}); fix the file") from None


def load_file(path: str | Path) -> Any:
    """A policy file as plain data, after :func:`check_file` (catalog, provenance, resolved policies)."""
    return parse(check_file(path), str(path))


def load_text(text: str, where: str) -> Any:
    """A short YAML text (an override's value) as data, with the same limits."""
    check_yaml(text, where)
    return parse(text, where)


@contextmanager
def guard_hydra_files(budget: Budget | None = None) -> Iterator[Budget]:
    """Check every file Hydra's file config source loads (for one compose), then restore Hydra.

    Enter it after Hydra is initialized: Hydra's plugin scan may load the source module a second time, so
    the class its registry hands out is patched as well as the importable one. ``load_config`` is
    Hydra-internal (hydra-core is pinned to 1.3); a test checks that the guard sees every file.
    """
    budget = budget if budget is not None else Budget()
    originals = {cls: cls.load_config for cls in _file_sources()}
    for cls, original in originals.items():
        cls.load_config = _guarded(original, budget)
    try:
        yield budget
    finally:
        for cls, original in originals.items():
            cls.load_config = original


def _file_sources() -> list[Any]:
    from hydra._internal.core_plugins.file_config_source import FileConfigSource
    from hydra._internal.sources_registry import SourcesRegistry

    classes: list[Any] = [FileConfigSource]
    try:
        registered = SourcesRegistry.instance().resolve("file")
    except ValueError:  # Hydra not initialized yet
        return classes
    return classes if registered is FileConfigSource else [*classes, registered]


def _guarded(original: Any, budget: Budget) -> Any:
    def load_config(self: Any, config_path: str) -> Any:
        full = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        if os.path.exists(full):  # else Hydra's own "not found" error
            check_file(full, budget)
        result = original(self, config_path)
        _refuse_hydra_section(result, config_path, full)
        return result

    return load_config


def _refuse_hydra_section(result: Any, config_path: str, file: str) -> None:
    """A top-level ``hydra:`` in a policy (the primary config or a ``_global_`` one) would be ignored."""
    from omegaconf import DictConfig

    config = getattr(result, "config", None)
    if not isinstance(config, DictConfig):  # Hydra itself refuses a config that is not a mapping
        return
    package = (getattr(result, "header", None) or {}).get("package")
    is_global = package == "_global_" or (package is None and "/" not in config_path.strip("/"))
    if is_global and "hydra" in config:
        raise PolicyError.single("hydra", f"in {file}: policies configure lifecycle, not Hydra: a `hydra:` "
                                 "section is refused (Hydra would ignore it here); remove it", has_value=False)
    defaults = config.get("defaults")
    for entry in defaults if isinstance(defaults, Sequence) and not isinstance(defaults, str) else []:
        names = list(entry.keys()) if hasattr(entry, "keys") else [entry]
        if any(_default_group(str(n)) == "hydra" for n in names):
            raise PolicyError.single("defaults", f"in {file}: policies configure lifecycle, not Hydra: the "
                                     f"defaults entry {str(entry)[:80]!r} is refused; remove it", has_value=False)


def _default_group(entry: str) -> str:
    """``override hydra/job_logging@x`` -> ``hydra``: the first folder a defaults entry names."""
    words = entry.split()
    name = words[-1] if words else ""
    return name.split("@")[0].lstrip("/").split("/")[0]


def _at(where: str, event: yaml.Event) -> str:
    mark = event.start_mark
    return f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def _error(where: str, message: str) -> PolicyError:
    return PolicyError.single(where, message, has_value=False)
