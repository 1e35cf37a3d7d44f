"""Step handlers (``train.kind``): the protocols a third-party kind implements, and the names a policy pack needs.

The registry that finds kinds by name and the built-in kinds' options models are policy data
(:mod:`lifecycle.policy.registry`, :mod:`lifecycle.policy.options`); the built-in implementations are backends
(:mod:`lifecycle.backends.synthetic`, :mod:`lifecycle.backends.megatron`). Importing this package imports neither
torch nor megatron.
"""

from lifecycle.handlers.protocols import SaveHandle, StepContext, StepHandler
from lifecycle.policy.options import ModelSize, SyntheticOptions
from lifecycle.policy.registry import HandlerSpec, register

__all__ = ["HandlerSpec", "ModelSize", "SaveHandle", "StepContext", "StepHandler", "SyntheticOptions", "register"]
