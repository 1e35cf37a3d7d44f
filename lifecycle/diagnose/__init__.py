"""``lifecycle diagnose``: read any failed job's logs, Flight Recorder dumps and error files, offline, and name
the culprit rank, group and op — or say that the evidence does not decide, and what is missing.

    from lifecycle.diagnose import diagnose
    result = diagnose(["job-logs/", "fr-dumps/"])      # a Result: result.as_json(), result.render()

Deterministic (the same inputs give the same verdict), streaming (no log is held whole in memory), pure Python
(no torch import). Files that cannot be used raise :class:`lifecycle.errors.RunDirError` naming them.
"""

from __future__ import annotations

from lifecycle.diagnose.report import Result, diagnose

__all__ = ["Result", "diagnose"]
