"""Hydra composes, pydantic validates.

compose (Hydra compose API over the built-in ``conf/``, user config dirs, installed policy packs and
overrides) -> ``OmegaConf.to_container(resolve=True, throw_on_missing=True)`` -> ``Policy.model_validate``.
Every failure on the way becomes a :class:`PolicyError` that lists ``key.path: message (got VALUE)``.
Hostile input is bounded before it costs anything: overrides (:mod:`lifecycle.policy.overrides`), every
YAML file Hydra reads (:mod:`lifecycle.policy.yamlguard`) and interpolations
(:mod:`lifecycle.policy.interpolation`).
Workers never compose: they read the resolved policy the launcher wrote to the run directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lifecycle.errors import PolicyError, PolicyIssue
from lifecycle.policy import installed, yamlguard
from lifecycle.policy.errors import clip, from_hydra, from_omegaconf, from_validation
from lifecycle.policy.interpolation import check_interpolations
from lifecycle.policy.kinds import is_schema_path, resolve
from lifecycle.policy.overrides import check_overrides, quote_unicode
from lifecycle.policy.packs import Pack, installed_packs, unusable_pack_for
from lifecycle.policy.roots import ConfigRoot, config_roots
from lifecycle.policy.schema import OWN_LOOP, Policy
from lifecycle.policy.timeouts import issues as timeout_issues
from lifecycle.rundir import RESOLVED, SHA256, safeio

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """A validated policy with the plain dict it came from and where it was composed from."""

    policy: Policy
    raw: dict[str, Any]
    source: str
    roots: tuple[ConfigRoot, ...] = ()
    """The search path with the origin of each folder (user dir, built-in, pack)."""
    overrides: tuple[str, ...] = ()
    """The overrides as given (before :func:`normalize_overrides`)."""
    config_name: str = "config"


@contextmanager
def hydra_session(roots: Sequence[ConfigRoot]) -> Iterator[str]:
    """Initialize Hydra on ``roots[0]`` for one compose; yields the ``hydra.searchpath`` override for the rest.

    Hydra's global state is cleared before and after, so nothing leaks into the next call or another app.
    Every file Hydra reads meanwhile is checked first (:func:`yamlguard.guard_hydra_files`).
    """
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    searchpath = "hydra.searchpath=[" + ",".join(_quoted(f"file://{r.path}") for r in roots[1:]) + "]"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(roots[0].path), version_base="1.3"), \
                yamlguard.guard_hydra_files():
            yield searchpath
    finally:
        GlobalHydra.instance().clear()


def _quoted(text: str) -> str:
    """A Hydra quoted string: folders may hold spaces, commas or brackets.

    Hydra's rule: inside quotes only a quote and the backslashes right before a quote (or the closing
    quote) are escaped; every other backslash is literal.
    """
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + "'"


def compose(overrides: Sequence[str] = (), *, config_dir: str | Path | None = None,
            config_name: str = "config") -> tuple[dict[str, Any], list[ConfigRoot]]:
    """Compose the policy as a plain dict (interpolations resolved) and the search path used."""
    from hydra import compose as hydra_compose
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    packs = installed_packs()
    roots = config_roots(config_dir, packs)
    _check_config_name(config_name)
    source = clip(f"{roots[0].path}/{config_name}.yaml")
    try:
        check_overrides(overrides, roots)
        # The user's dir comes first so it can override any built-in or pack file of the same name.
        with hydra_session(roots) as searchpath:
            cfg = hydra_compose(config_name=config_name,
                                overrides=[*normalize_overrides(overrides), searchpath])
        check_interpolations(OmegaConf.to_container(cfg, resolve=False))
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except PolicyError as exc:
        raise PolicyError(exc.issues, source=source) from None
    except OmegaConfBaseException as exc:
        raise from_omegaconf(exc, source) from None
    except yaml.YAMLError as exc:  # one the guard's parser let through (an undefined alias...)
        name = getattr(getattr(exc, "problem_mark", None), "name", None) or ""
        where = name if name and not name.startswith("<") else source
        raise PolicyError(yamlguard.yaml_error(exc, where).issues, source=source) from None
    except Exception as exc:  # noqa: BLE001 - Hydra raises a zoo of types; all come from the user's input here
        log.debug("compose failed", exc_info=True)
        _raise_if_from_unusable_pack(exc, packs)
        raise from_hydra(exc, source, overrides) from None
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}, roots


def _check_config_name(name: str) -> None:
    """A config name is a file name under the config dir, without ``.yaml``."""
    if not name or len(name) > 255 or "\x00" in name or name.startswith("/") or ".." in name.split("/"):
        raise PolicyError.single("--config-name", "must be a file name in the config dir, without .yaml "
                                 "(e.g. house, or preset/moe)", name)


def _raise_if_from_unusable_pack(exc: Exception, packs: list[Pack]) -> None:
    """A config Hydra cannot find that an unusable pack ships: the pack's own error says why."""
    missing = getattr(exc, "missing_cfg_file", None)
    pack = unusable_pack_for(missing, packs) if isinstance(missing, str) else None
    if pack is not None:
        pack.check(missing)


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """``key=value`` on a key the schema knows becomes ``++key=value``.

    Hydra only overrides keys present in the composed YAML; policy keys left at their schema default are
    absent there, so a plain ``checkpoint.async=true`` would be refused. A key the schema does not know is
    passed on unchanged and Hydra's error names it. A plain non-ASCII value is quoted (:func:`quote_unicode`).
    """
    out = []
    for override in map(quote_unicode, overrides):
        key, sep, _ = override.partition("=")
        if sep and key and key[0] not in "+~" and "." in key and is_schema_path(key):
            override = "++" + override
        out.append(override)
    return out


def validate(data: dict[str, Any], *, source: str | None = None, own_loop: bool = False) -> Policy:
    """Validate a plain dict; every problem becomes one PolicyIssue. ``own_loop``: for ``lifecycle.attach`` (the
    trainer's model: ``train.options`` is not held against the layout)."""
    targets = list(_find_targets(data, ""))
    if targets:
        raise PolicyError([PolicyIssue(t, "a policy never names code: `_target_` is not allowed; choose a "
                                       "handler by `kind` from the registry", "_target_") for t in targets],
                          source=source)
    try:
        policy = Policy.model_validate(data, context={OWN_LOOP: True} if own_loop else None)
    except ValidationError as exc:
        raise from_validation(exc, source) from None
    except PolicyError as exc:
        raise PolicyError(exc.issues, source=source) from None
    try:  # the train kind against the installed kinds: the one step that reads what is installed
        policy = resolve(policy, own_loop=own_loop)
    except PolicyError as exc:
        raise PolicyError(exc.issues, source=source) from None
    needs = installed.issues(policy.checkpoint.async_strategy)  # a key that needs an installed package
    if needs:
        raise PolicyError(needs, source=source)
    chain = timeout_issues(policy)  # the timeout chain reads the built policy (its layer sits above the schema)
    if chain:
        raise PolicyError(chain, source=source)
    return policy


def _find_targets(node: Any, path: str) -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{path}.{k}" if path else str(k)
            if k == "_target_":
                found.append(key)
            found.extend(_find_targets(v, key))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found.extend(_find_targets(v, f"{path}.{i}"))
    return found


def load(overrides: Sequence[str] = (), *, config_dir: str | Path | None = None,
         config_name: str = "config", own_loop: bool = False) -> Loaded:
    """Compose and validate a policy (``own_loop``: see :func:`validate`)."""
    data, roots = compose(overrides, config_dir=config_dir, config_name=config_name)
    source = f"{roots[0].path}/{config_name}.yaml"
    policy = validate(data, source=source, own_loop=own_loop)
    return Loaded(policy, data, source, tuple(roots), tuple(overrides), config_name)


def to_plain(policy: Policy) -> dict[str, Any]:
    """The policy as plain data with YAML key names (``async``, not ``async_``)."""
    return policy.model_dump(mode="json", by_alias=True)


def sha256(policy: Policy) -> str:
    """A stable digest of the resolved policy (identical on every rank for the same policy).

    ``run.dir`` is left out: it says where a node keeps its own files (it may differ between the nodes of one
    job), not what the job does. ``checkpoint.dir`` is in: every rank must write to the same one.
    """
    plain = to_plain(policy)
    plain["run"] = {k: v for k, v in plain["run"].items() if k != "dir"}
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def write_resolved(policy: Policy, run_dir: Path) -> Path:
    """Write the resolved policy and its sha256 into the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESOLVED
    safeio.write_text(path, yaml.safe_dump(to_plain(policy), sort_keys=False))
    safeio.write_text(run_dir / SHA256, sha256(policy) + "\n")
    return path


def read_resolved(path: Path) -> Policy:
    """Load a resolved policy file (what workers do); errors name the file."""
    data = yamlguard.load_file(path)
    if not isinstance(data, dict):
        raise PolicyError.single(str(path), "is not a mapping", type(data).__name__)
    return validate(data, source=str(path))
