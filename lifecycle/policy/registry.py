"""Handler registry: handler kinds chosen by name from YAML, never by import path.

A kind is registered with a :class:`HandlerSpec`: the phase it serves, a pydantic model for its
options (validated at policy load, so it must import without torch) and a factory given here, in
Python, as ``"module:attr"`` — the YAML only ever names the *kind*. Built-in kinds are listed below;
installed packages add kinds through the entry-point group ``lifecycle.handlers``, whose objects are a
``HandlerSpec`` or a list of them. Users can also call :func:`register` before loading a policy.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import BaseModel

from lifecycle.errors import PolicyError
from lifecycle.policy import imports
from lifecycle.policy.options import MegatronGPTOptions, SyntheticOptions

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "lifecycle.handlers"


@dataclass(frozen=True)
class HandlerSpec:
    """A named handler kind for one phase."""

    kind: str
    phase: str
    options: type[BaseModel]
    factory: str
    description: str = ""
    source: str = field(default="built-in", compare=False)
    entry_point: str = field(default="", compare=False)
    """``name = module:attr`` of the entry point that registered the kind (empty for a built-in or ``register``)."""
    groups: str = "megatron"
    """Who creates the model-parallel groups the kind runs on: ``megatron`` (megatron-core's ``parallel_state``,
    which the kind may then use itself) or ``torch`` (the same groups made with ``torch.distributed`` alone, by
    :class:`lifecycle.distributed.native.NativeParallel`: megatron is never imported, seconds saved per rank)."""

    def __post_init__(self) -> None:
        if self.groups not in ("megatron", "torch"):
            raise ValueError(f"HandlerSpec({self.kind!r}).groups must be 'megatron' or 'torch', got {self.groups!r}")

    def load(self) -> Any:
        """Import and return the factory (this may import torch and megatron)."""
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)


_BUILTINS = [
    HandlerSpec("megatron_gpt", "train", MegatronGPTOptions,
                "lifecycle.backends.megatron.step:MegatronGPTStep",
                "a megatron-core GPTModel (MoE optional) with Megatron DDP and optimizer"),
    HandlerSpec("synthetic", "train", SyntheticOptions,
                "lifecycle.backends.synthetic:SyntheticStep",
                "a tiny torch model with a data-parallel all-reduce per step (no megatron)", groups="torch"),
]
_registry: dict[tuple[str, str], HandlerSpec] = {}
_entry_points_loaded = False


def register(spec: HandlerSpec, *, replace: bool = False) -> None:
    """Register a handler kind. Raises if the kind exists for that phase, unless ``replace``."""
    key = (spec.phase, spec.kind)
    if key in _registry and not replace and _registry[key] != spec:
        raise ValueError(f"handler kind '{spec.kind}' for phase '{spec.phase}' is already registered "
                         f"by {_registry[key].source}")
    _registry[key] = spec


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            specs = imports.bounded(ep.module, functools.partial(_specs_of, ep))
        except KeyboardInterrupt:
            raise
        except TimeoutError as exc:
            log.warning("handler entry point %s (%s) is left out: importing '%s' %s (raise %s if it is only slow)",
                        ep.name, dist, ep.module, exc, imports.ENV_TIMEOUT)
            continue
        except BaseException as exc:  # noqa: BLE001 - a broken package (SystemExit included) breaks nothing else
            log.warning("handler entry point %s (%s) failed to load and is left out: %s: %s", ep.name, dist,
                        type(exc).__name__, exc)
            continue
        for spec in specs if isinstance(specs, list | tuple) else [specs]:
            if not isinstance(spec, HandlerSpec):
                log.warning("entry point %s (%s) gave %r, not a HandlerSpec", ep.name, dist, spec)
                continue
            if any(spec.kind == b.kind and spec.phase == b.phase for b in _BUILTINS):
                log.warning("entry point %s (%s) registers the built-in kind %r and is left out", ep.name, dist,
                            spec.kind)
                continue
            try:
                register(HandlerSpec(spec.kind, spec.phase, spec.options, spec.factory, spec.description,
                                     source=f"package {dist}", groups=spec.groups,
                                     entry_point=f"{ep.name} = {ep.value}"))
            except ValueError as exc:
                log.warning("entry point %s (%s) is left out: %s", ep.name, dist, exc)


def _specs_of(ep: EntryPoint) -> object:
    """What the entry point gives: a HandlerSpec, a list of them, or a callable returning either."""
    obj = ep.load()
    return obj() if callable(obj) and not isinstance(obj, HandlerSpec) else obj


def factory_issue(spec: HandlerSpec) -> str | None:
    """Why ``spec``'s factory cannot build a step handler (:mod:`lifecycle.policy.factory`), found without running
    the factory's module; None when it can, and for the built-in kinds."""
    if spec in _BUILTINS:
        return None
    from lifecycle.policy.factory import factory_problem

    problem = factory_problem(spec.factory)
    if problem is None:
        return None
    where = f"entry point '{spec.entry_point}' of {spec.source}" if spec.entry_point else f"registered by {spec.source}"
    return (f"{spec.phase} handler kind '{spec.kind}' ({where}) cannot build a handler: {problem}; fix the entry point "
            f"or reinstall that package, or choose another kind ({', '.join(k for k in kinds(spec.phase))})")


def _ensure() -> None:
    for spec in _BUILTINS:
        _registry.setdefault((spec.phase, spec.kind), spec)
    _load_entry_points()


def kinds(phase: str) -> list[str]:
    """Every registered kind for ``phase``, sorted."""
    _ensure()
    return sorted(k for p, k in _registry if p == phase)


def get(phase: str, kind: str, *, path: str | None = None) -> HandlerSpec:
    """The spec for ``kind``; a miss is a PolicyError listing the available names."""
    _ensure()
    spec = _registry.get((phase, kind))
    if spec is None:
        raise PolicyError.single(
            path or f"{phase}.kind",
            f"unknown {phase} handler kind; available names: {', '.join(kinds(phase))}", kind)
    return spec


def all_specs(phase: str) -> list[HandlerSpec]:
    """Every registered spec of ``phase``."""
    _ensure()
    return [s for (p, _), s in sorted(_registry.items()) if p == phase]
