"""JSON Schema of the policy, for editors (yaml-language-server) and `lifecycle schema`."""

from __future__ import annotations

from typing import Any

from lifecycle.policy import registry
from lifecycle.policy.schema import Policy


def policy_json_schema() -> dict[str, Any]:
    """The policy's JSON Schema; ``train.options`` is any of the registered kinds' options."""
    schema = Policy.model_json_schema(by_alias=True, mode="validation")
    defs = schema.setdefault("$defs", {})
    variants = []
    for spec in registry.all_specs("train"):
        sub = spec.options.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
        defs.update(sub.pop("$defs", {}))
        sub["description"] = f"options of train kind '{spec.kind}' ({spec.source}): {spec.description}"
        defs[spec.options.__name__] = sub
        variants.append({"$ref": f"#/$defs/{spec.options.__name__}"})
    train = defs["TrainConfig"]["properties"]
    train["options"] = {"anyOf": [*variants, {"type": "null"}], "description": train["options"].get(
        "description", "")}
    train["kind"]["enum"] = registry.kinds("train")
    default = schema["properties"]["train"].get("default")
    if isinstance(default, dict) and default.get("options") is None:  # the default kind's own defaults
        default["options"] = registry.get("train", default["kind"]).options().model_dump(by_alias=True, mode="json")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lifecycle policy"
    return schema
