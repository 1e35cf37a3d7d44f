"""What starts processes (internal; the public API is :mod:`lifecycle`).

- :mod:`~lifecycle.launch.runner`: ``lifecycle run`` — compose, check, take the run directory, launch, summarise;
- :mod:`~lifecycle.launch.local`: the local launcher (``--nproc`` ranks, the agent-hosted store, shutdown);
- :mod:`~lifecycle.launch.preload`: ranks forked from one process that imported torch once;
- :mod:`~lifecycle.launch.worker`: one rank's process (``python -m lifecycle.launch.worker RUN_DIR``); the rank's
  run itself is :mod:`lifecycle.machine.session`, shared with ``lifecycle.attach()``.

The run directory's files, attempts and lock are :mod:`lifecycle.rundir`; what a rank checks and takes of it before it
starts is :mod:`lifecycle.machine.preflight` and :mod:`lifecycle.machine.rankdir`.
"""
