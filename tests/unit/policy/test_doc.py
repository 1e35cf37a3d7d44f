"""Generated artefacts stay in sync with the schema: the policy table of docs/policy.md and the JSON Schema file."""

from __future__ import annotations

import json

from lifecycle.policy.doc import BEGIN, END, PAGE, table
from lifecycle.policy.jsonschema import policy_json_schema
from tests.helpers import ROOT


def test_policy_page_table_is_current() -> None:
    page = (ROOT / PAGE).read_text()
    current = page[page.index(BEGIN): page.index(END) + len(END)]
    assert current == table(), "regenerate with: python -m lifecycle.policy.doc --write"


def test_the_readme_leaves_the_table_to_the_policy_page() -> None:
    assert BEGIN not in (ROOT / "README.md").read_text()


def test_schema_file_is_current() -> None:
    on_disk = json.loads((ROOT / "lifecycle.schema.json").read_text())
    assert on_disk == policy_json_schema(), "regenerate with: lifecycle schema > lifecycle.schema.json"


def test_every_key_is_documented() -> None:
    assert "| `checkpoint.async` |" in table() and "| `faults[].action` |" in table()
    undocumented = [line for line in table().splitlines()[3:-1] if line.rstrip().endswith("|  |")]
    assert not undocumented
