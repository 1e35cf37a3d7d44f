"""megatron-core's ``jit_fuser`` left out where no GPU can use it.

megatron-core decorates its fusions with ``jit_fuser`` (``torch.compile`` since torch 2.2) at import: that imports
torch's whole compiler stack (dynamo and inductor, about 2 of the 4.4 s a rank spends importing torch and megatron-core
on a 2-CPU machine), and a fusion called on a CPU would first be built with a C++ compiler. On a machine without an
NVIDIA driver no fusion can run on a GPU, so :func:`install` hooks the import of ``megatron.core.jit`` and calls
megatron's own ``disable_jit_fuser()`` right after that module runs — before the fusion modules take ``jit_fuser`` by
value. With a driver, or when ``megatron.core.jit`` was imported before lifecycle's backend, megatron's default stays.
The built-in kinds turn every fusion off in their model config (model.py), so their numbers do not change.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

NAME = "megatron.core.jit"


class _DisableAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` the usual way and disables its fuser once the module has run; removes itself."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != NAME:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        run = getattr(loader, "exec_module", None)
        if spec is None or loader is None or run is None:
            return spec

        def exec_module(module: ModuleType) -> None:
            run(module)
            disable = getattr(module, "disable_jit_fuser", None)
            if callable(disable):
                disable()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> bool:
    """Hook the import of ``megatron.core.jit`` on a machine without an NVIDIA driver (``LIFECYCLE_MEGATRON_JIT=1``
    keeps megatron's default); whether the hook is in place."""
    if NAME in sys.modules or os.environ.get("LIFECYCLE_MEGATRON_JIT", "").strip() in ("1", "true", "yes", "on"):
        return False
    from lifecycle.distributed.comm_memory import has_nvidia_driver

    if has_nvidia_driver():
        return False
    if not any(isinstance(f, _DisableAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _DisableAfterImport())
    return True
