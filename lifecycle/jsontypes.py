"""Types of JSON data that comes from outside the process: store records, event lines, marker and report
files. Their shape is checked where they are read; this is the one place where ``Any`` is the honest type
(the strictly typed packages use these aliases, never ``Any`` itself)."""

from __future__ import annotations

from typing import Any

Json = Any
"""A decoded JSON value of unchecked shape."""
JsonDict = dict[str, Any]
"""A decoded JSON object (a record, an event, a report)."""
