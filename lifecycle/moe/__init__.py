"""Mixture-of-experts safeguards that work on any Megatron-Core MoE model (torch only, no megatron import)."""

from lifecycle.moe.zero_token import (
    ACTIONS,
    ZeroTokenGuard,
    find_experts_modules,
    install_zero_token_guard,
)

__all__ = ["ACTIONS", "ZeroTokenGuard", "find_experts_modules", "install_zero_token_guard"]
