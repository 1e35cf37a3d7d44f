"""The policy's train kind resolved against the installed handler kinds: the one step of loading a policy that
depends on what is installed (policy packs add kinds through entry points).

:mod:`lifecycle.policy.schema` validates the policy as data (``train.kind`` a name, ``train.options`` a mapping);
:func:`resolve` then looks the kind up in the registry (did-you-mean on a typo, a kind whose factory cannot be
imported named), validates ``train.options`` against the kind's options model and applies the rules that read the
model's options (experts against ep, the shapes megatron-core checks at build, the model's size). The dotted keys of
every installed kind's options (for override syntax and did-you-mean hints) are here for the same reason.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from lifecycle.errors import PolicyError, PolicyIssue
from lifecycle.policy import registry
from lifecycle.policy.modelsize import model_size_issues
from lifecycle.policy.schema import DistributedConfig, Policy, TrainConfig, divisors


def resolve(policy: Policy, *, own_loop: bool = False) -> Policy:
    """``policy`` with ``train.options`` as the kind's options model; every problem a :class:`PolicyError`.
    ``own_loop`` (``lifecycle.attach``): the trainer builds its model, so its options are not held against the
    layout."""
    train = policy.train
    options = _options(train.kind, train.options)
    resolved = policy.model_copy(update={"train": train.model_copy(update={"options": options})})
    issues = option_issues(resolved, own_loop=own_loop)
    if issues:
        raise PolicyError(issues)
    return resolved


def _options(kind: str, given: Any) -> BaseModel:
    spec = registry.get("train", kind, path="train.kind")
    broken = registry.factory_issue(spec)
    if broken is not None:
        raise PolicyError.single("train.kind", broken, kind)
    if isinstance(given, spec.options):
        return given
    try:
        return spec.options.model_validate({} if given is None else given)
    except ValidationError as exc:
        from lifecycle.policy.errors import from_validation

        err = from_validation(exc, None, prefix="train.options")
        hint = (f"not an option of train kind '{kind}' (options: {', '.join(spec.options.model_fields)}); "
                "switching kinds? drop the old options with ~train.options")
        raise PolicyError([PolicyIssue(i.path, hint, i.value) if "unknown key" in i.message else i
                           for i in err.issues]) from None


def option_issues(p: Policy, *, own_loop: bool = False) -> list[PolicyIssue]:
    """The cross-field rules that read the kind's options (``p`` resolved)."""
    issues: list[PolicyIssue] = []
    experts = None if own_loop else getattr(p.train.options, "num_experts", None)
    ep = p.parallelism.ep
    if experts is not None and ep > 1:
        if experts == 0:
            issues.append(PolicyIssue("parallelism.ep", "ep > 1 needs a MoE model; set train.options."
                                      "num_experts or parallelism.ep=1", ep))
        elif ep > experts or experts % ep:
            issues.append(PolicyIssue(
                "parallelism.ep", f"must divide train.options.num_experts ({experts}); pick ep in "
                f"{divisors(experts)}", ep))
    if not own_loop:
        issues.extend(_model_shape_issues(p))
        issues.extend(model_size_issues(p.train.options, p.parallelism, p.train.steps))
    if p.moe.zero_token.action != "off" and experts == 0:
        issues.append(PolicyIssue("moe.zero_token.action", "the model has no experts (train.options."
                                  "num_experts=0); set it to off", p.moe.zero_token.action))
    return issues


def _divides(issues: list[PolicyIssue], key: str, size: int, what: str, value: int | None) -> None:
    if value is not None and size > 1 and value % size:
        issues.append(PolicyIssue(key, f"must divide {what} ({value}); megatron would refuse the model at build",
                                  size))


def _model_shape_issues(p: Policy) -> list[PolicyIssue]:
    """What megatron-core checks when it builds the model, checked before anything starts (options of any kind
    that has them: heads, layers, ffn_hidden, seq_len, num_experts)."""
    o, par = p.train.options, p.parallelism
    if p.train.steps == 0 or o is None:
        return []
    issues: list[PolicyIssue] = []
    heads, layers = getattr(o, "heads", None), getattr(o, "num_layers", None)
    ffn, seq = getattr(o, "ffn_hidden", None), getattr(o, "seq_len", None)
    _divides(issues, "parallelism.tp", par.tp, "train.options.heads", heads)
    _divides(issues, "parallelism.tp", par.tp, "train.options.ffn_hidden", ffn)
    # tensor parallelism runs with sequence parallelism (megatron requires it with expert parallelism)
    _divides(issues, "parallelism.tp", par.tp, "train.options.seq_len (sequence parallel)", seq)
    _divides(issues, "parallelism.etp", par.expert_tp, "train.options.ffn_hidden (expert tensor parallel)",
             ffn if getattr(o, "num_experts", 0) else None)
    stages = par.pp * (par.vpp or 1)
    if layers is not None and stages > 1 and layers % stages:
        issues.append(PolicyIssue("train.options.num_layers", f"must be divisible by pp x vpp = {par.pp} x "
                                  f"{par.vpp or 1} = {stages} (one equal share of layers per pipeline stage)",
                                  layers))
    if seq is not None and par.cp > 1 and seq % (2 * par.cp):
        issues.append(PolicyIssue("train.options.seq_len", f"must be divisible by 2 x cp = {2 * par.cp} (context "
                                  f"parallel splits each sequence into 2 x cp chunks)", seq))
    return issues



def schema_paths() -> list[str]:
    """Every dotted key of the policy (and of every registered kind's options), for "did you mean" hints."""
    out: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, sub in _aliases(model).items():
            out.append(prefix + name)
            if model is TrainConfig and name == "options":
                for spec in registry.all_specs("train"):
                    out.extend(f"{prefix}options.{k}" for k in _aliases(spec.options))
            elif model is DistributedConfig and name == "nccl_env":
                from lifecycle.policy.nccl import KNOBS

                out.extend(f"{prefix}nccl_env.{k}" for k in KNOBS)
            elif sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(Policy, "")
    return sorted(set(out))


def is_schema_path(dotted: str) -> bool:
    """Whether ``dotted`` (``checkpoint.async``, ``train.options.hidden``) names a policy key."""
    model: type[BaseModel] | None = Policy
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if model is None:
            return False
        if model is TrainConfig and part == "options" and i + 1 < len(parts):
            rest = parts[i + 1]
            return any(rest in _aliases(spec.options) for spec in registry.all_specs("train"))
        if model is DistributedConfig and part == "nccl_env" and i + 1 < len(parts):
            return len(parts) == i + 2  # a name in the mapping: the field checks it against the allow-list
        fields = _aliases(model)
        if part not in fields:
            return False
        model = fields[part]
    return True


def _aliases(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    out: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        out[info.alias or name] = sub
    return out
