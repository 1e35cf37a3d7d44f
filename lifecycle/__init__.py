"""lifecycle: declarative lifecycle policies for Megatron-Core training jobs.

The public face (everything else is internal and may change)::

    import lifecycle
    with lifecycle.attach(overrides=["preset=moe"]) as job:   # every rank
        job.watch(model, optimizer)
        for step in job.steps(total):
            ...                                               # the trainer's own step

``import lifecycle`` imports no torch: the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lifecycle.errors import (
    CheckpointError,
    HangError,
    JobFailed,
    LifecycleError,
    PhaseError,
    PolicyError,
    TransitionError,
    UsageError,
)
from lifecycle.policy.versions import LIBRARY_VERSION
from lifecycle.policy.versions import SCHEMA_VERSION as SCHEMA_VERSION

if TYPE_CHECKING:
    from lifecycle.machine.job import Job, attach
    from lifecycle.moe import install_zero_token_guard
    from lifecycle.phases.train import Decision
    from lifecycle.policy.load import load as load_policy
    from lifecycle.policy.registry import HandlerSpec
    from lifecycle.policy.schema import Policy

__version__ = LIBRARY_VERSION

__all__ = ["CheckpointError", "Decision", "HandlerSpec", "HangError", "Job", "JobFailed", "LifecycleError", "PhaseError",
           "Policy", "PolicyError", "TransitionError", "UsageError", "attach", "install_zero_token_guard",
           "load_policy"]

_LAZY = {"attach": ("lifecycle.machine.job", "attach"), "Job": ("lifecycle.machine.job", "Job"),
         "Decision": ("lifecycle.phases.train", "Decision"), "HandlerSpec": ("lifecycle.policy.registry", "HandlerSpec"),
         "install_zero_token_guard": ("lifecycle.moe", "install_zero_token_guard"),
         "load_policy": ("lifecycle.policy.load", "load"), "Policy": ("lifecycle.policy.schema", "Policy")}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'lifecycle' has no attribute {name!r}")
