"""Recovery: everything that decides and carries out what happens after a failure, in one place.

- :mod:`~lifecycle.recovery.decisions` — the launcher's restart decisions (another attempt or not, the restarts
  budget, what the next attempt resumes from, the memory tier's copies at the end of a run);
- :mod:`~lifecycle.recovery.progress` — the no-progress verdict (the restarts ledger against the tracker's step);
- :mod:`~lifecycle.recovery.exclusions` — the hosts the verdicts blamed, for the next allocation;
- :mod:`~lifecycle.recovery.inprocess` — restarts in the same processes (``restart.mode: in_process``);
- :mod:`~lifecycle.recovery.resume` — resume from either tier, the same state on every rank;
- :mod:`~lifecycle.recovery.memory` and :mod:`~lifecycle.recovery.copies` — the in-memory tier and its files;
- :mod:`~lifecycle.recovery.state_check` and :mod:`~lifecycle.recovery.rejections` — checked states: never save a
  non-finite or diverged state, reject one whose first step after a restore is bad.

It stands above ``checkpoint/`` (the folder's files), ``context``, ``watchdog/`` and below ``phases/`` (which run
it at init, at step boundaries and in the checkpoint phase), ``machine/`` and ``launch/``. The attempts ledger it
reads stays on the ground floor (:mod:`lifecycle.rundir.restarts`): the summary and goodput read it too. Internal.
"""
