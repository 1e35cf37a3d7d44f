"""``with_experts``: the skip-empty experts put into every shape of MoE spec megatron-core has shipped.

Up to 0.16 the experts are a ``ModuleSpec`` inside the MoE layer's ``ModuleSpec``; 0.17 and 0.18 put a
``functools.partial`` of ``SequentialMLP`` there; 0.19 makes the MoE layer itself a partial. The three shapes are built
here from the installed megatron-core's own classes, so one stack checks them all; the installed version's own spec
function is checked too.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron


def _shapes() -> dict[str, Any]:
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    mlp = MLPSubmodules(linear_fc1=object, linear_fc2=object)
    return {
        "0.16": ModuleSpec(module=MoELayer, submodules=MoESubmodules(
            experts=ModuleSpec(module=SequentialMLP, submodules=mlp))),
        "0.17-0.18": ModuleSpec(module=MoELayer, submodules=MoESubmodules(
            experts=functools.partial(SequentialMLP, submodules=mlp))),
        "0.19": functools.partial(MoELayer, submodules=MoESubmodules(
            experts=functools.partial(SequentialMLP, submodules=mlp))),
    }


def _experts_of(spec: Any) -> tuple[Any, Any]:
    """(the class the experts build as, their submodules)."""
    subs = spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules
    experts = subs.experts
    if isinstance(experts, functools.partial):
        return experts.func, experts.keywords["submodules"]
    return experts.module, experts.submodules


@pytest.mark.parametrize("shape", ["0.16", "0.17-0.18", "0.19"])
def test_every_shape_of_moe_spec_gets_the_skip_empty_experts_with_its_submodules(shape: str) -> None:
    from lifecycle.backends.megatron.experts import skip_empty_experts, with_experts

    spec = _shapes()[shape]
    _, submodules = _experts_of(spec)
    out = with_experts(spec, skip_empty_experts())
    assert _experts_of(out) == (skip_empty_experts(), submodules)


def test_the_installed_layer_spec_and_a_dense_one() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lifecycle.backends.megatron.experts import skip_empty_experts, with_experts
    from lifecycle.errors import UsageError

    layer = with_experts(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False), skip_empty_experts())
    assert _experts_of(layer.submodules.mlp)[0] is skip_empty_experts()
    with pytest.raises(UsageError, match="has no experts module to replace"):
        with_experts(get_gpt_layer_local_spec(), skip_empty_experts())
