"""``train.kind: acme_synthetic`` — lifecycle's synthetic step with a linear learning-rate warm-up."""

from __future__ import annotations

from typing import Any

from lifecycle.backends.synthetic import SyntheticStep
from lifecycle.context import RunContext
from lifecycle.handlers import SyntheticOptions


class AcmeWarmupStep(SyntheticStep):
    """Each step runs with ``lr * min(1, step / lr_warmup_steps)`` and reports it."""

    def __init__(self, options: Any) -> None:
        self.acme = options
        super().__init__(SyntheticOptions(hidden=options.hidden, batch=options.batch, lr=options.lr))

    def step(self, ctx: RunContext, step: int) -> dict[str, float]:
        warm = self.acme.lr_warmup_steps
        lr = self.acme.lr * (min(1.0, step / warm) if warm else 1.0)
        self.o = self.o.model_copy(update={"lr": lr})
        return {**super().step(ctx, step), "lr": lr}
