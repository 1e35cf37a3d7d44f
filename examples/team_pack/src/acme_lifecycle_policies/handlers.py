"""The handler kinds of this pack (entry-point group ``lifecycle.handlers``).

Only pydantic here: lifecycle imports this module whenever it validates a policy, without torch. The
factory is named in Python as ``module:attr`` and imported only when a run builds the handler.
"""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from lifecycle.handlers import HandlerSpec
from lifecycle.policy.base import Section


class AcmeSyntheticOptions(Section):
    """The synthetic data-parallel MLP with ACME's linear learning-rate warm-up."""

    hidden: PositiveInt = 32
    """Width of the MLP."""
    batch: PositiveInt = 8
    """Samples per rank and step."""
    lr: PositiveFloat = 0.05
    """Peak SGD learning rate."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up (step 1 runs at lr/lr_warmup_steps); 0 starts at the peak."""


SPECS = [
    HandlerSpec("acme_synthetic", "train", AcmeSyntheticOptions, "acme_lifecycle_policies.step:AcmeWarmupStep",
                "the synthetic data-parallel MLP with ACME's linear LR warm-up", groups="torch"),
]
