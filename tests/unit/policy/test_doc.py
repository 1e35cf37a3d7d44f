"""Generated artefacts stay in sync with the schema: the README's policy table and the JSON Schema file."""

from __future__ import annotations

import json

from lifecycle.policy.doc import BEGIN, END, table
from lifecycle.policy.jsonschema import policy_json_schema
from tests.helpers import ROOT


def test_readme_policy_table_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    current = readme[readme.index(BEGIN): readme.index(END) + len(END)]
    assert current == table(), "regenerate with: python -m lifecycle.policy.doc"


def test_schema_file_is_current() -> None:
    on_disk = json.loads((ROOT / "lifecycle.schema.json").read_text())
    assert on_disk == policy_json_schema(), "regenerate with: lifecycle schema > lifecycle.schema.json"


def test_every_key_is_documented() -> None:
    assert "| `checkpoint.async` |" in table() and "| `faults[].action` |" in table()
    undocumented = [line for line in table().splitlines()[3:-1] if line.rstrip().endswith("|  |")]
    assert not undocumented
