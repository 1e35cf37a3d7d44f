"""A pickle loader for input from machines you do not trust: plain containers and numbers, nothing else.

A Flight Recorder dump is a pickle (torch's C++ pickler: dicts, lists, tuples, strings, numbers, None, booleans).
``pickle.load`` would import and call whatever a pickle names: a ``__reduce__`` payload runs code. Here every
opcode that names a Python object (GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ, EXT*, persistent ids) reaches
:meth:`_Restricted.find_class` or ``persistent_load``, and both refuse — except the few list builders torch's
pickler itself writes (``torch.jit._pickle.build_intlist`` ...), which map to ``list`` without importing anything.
The loader reads from memory (the dump is read whole, bounded by :data:`files.MAX_DUMP`), so a length field can
never make it allocate more than the file holds, and it builds only dicts, lists, tuples, strings, bytes, numbers,
booleans, None (and sets): no object of a class. Its result is never walked blindly: the dump reader takes the
known fields, checks each one's type and bounds what it keeps, so shared references that would expand
exponentially, or lists nested a million deep, are never followed. A refused or truncated pickle is a
:class:`RunDirError` naming the file (exit 2); one that names a Python object met while walking a folder (a
checkpoint beside the logs) is skipped and counted instead, nothing of it imported or called.

Pure Python: no torch.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

from lifecycle.errors import RunDirError
from lifecycle.jsontypes import Json

_SAFE_BUILDERS = {("torch.jit._pickle", name) for name in (
    "build_intlist", "build_doublelist", "build_boollist", "build_genericlist", "build_stringlist")}


def _build_list(items: object = ()) -> list[object]:
    return list(items) if isinstance(items, list | tuple) else []


def _same(value: object, *_: object) -> object:
    return value


class _Restricted(pickle.Unpickler):
    foreign = False
    """Set when the pickle named a Python object or held a persistent id: not plain data (a checkpoint, a payload)."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _SAFE_BUILDERS:
            return _build_list
        if (module, name) == ("torch.jit._pickle", "restore_type_tag"):
            return _same
        self.foreign = True
        raise pickle.UnpicklingError(f"it names a Python object ({module}.{name}); a Flight Recorder dump holds "
                                     f"only plain data, and this loader never imports or calls anything")

    def persistent_load(self, pid: object) -> object:
        self.foreign = True
        raise pickle.UnpicklingError("it holds a persistent id (tensors or storages), which a Flight Recorder "
                                     "dump never has")


def loads(data: bytes, path: Path, *, foreign: str = "refuse") -> Json:
    """The plain data in ``data``; anything else is a RunDirError naming ``path``. With ``foreign="none"``, a
    pickle that names a Python object (a checkpoint met while walking a folder) is None instead: refused all the
    same, nothing of it imported or called."""
    loader = _Restricted(io.BytesIO(data))
    try:
        value = loader.load()
    except pickle.UnpicklingError as exc:
        if loader.foreign and foreign == "none":
            return None
        why = f"truncated or damaged ({exc})" if "truncated" in str(exc) else str(exc)
        raise RunDirError(f"{path}: refused as a pickle: {why}", path=str(path)) from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError, OverflowError,
            RecursionError) as exc:
        raise RunDirError(f"{path}: not a complete pickle ({type(exc).__name__}: {str(exc)[:200]}); truncated "
                          f"or not a Flight Recorder dump", path=str(path)) from None
    return value
