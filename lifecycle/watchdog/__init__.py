"""Deadlines, heartbeats and the collective-sequence check; a hang named within seconds (internal).

:class:`~lifecycle.watchdog.core.Watchdog` is the per-rank thread; :mod:`~lifecycle.watchdog.diagnosis` turns what
the ranks report into one verdict; :mod:`~lifecycle.watchdog.report` writes it; :mod:`~lifecycle.watchdog.adaptive`
learns deadlines; :mod:`~lifecycle.watchdog.straggler` names slow ranks.
"""
