"""Step handlers (``train.kind``): the registry that finds them by name, their options models and the
protocols a third-party kind implements. Importing this package imports neither torch nor megatron."""

from lifecycle.handlers.protocols import SaveHandle, StepHandler
from lifecycle.handlers.registry import HandlerSpec, register

__all__ = ["HandlerSpec", "SaveHandle", "StepHandler", "register"]
