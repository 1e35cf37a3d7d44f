"""What starts ranks and owns the run directory (internal; the public API is :mod:`lifecycle`).

- :mod:`~lifecycle.launch.runner`: ``lifecycle run`` — compose, check, prepare the run directory, launch, summarise;
- :mod:`~lifecycle.launch.local`: the local launcher (``--nproc`` ranks, the agent-hosted store, shutdown);
- :mod:`~lifecycle.launch.worker`: one rank (``python -m lifecycle.launch.worker RUN_DIR``, or under torchrun/srun);
- :mod:`~lifecycle.launch.preflight`: what the files and the environment show before any rank starts;
- :mod:`~lifecycle.rundir`: the run directory's files, attempts and lock;
- :mod:`~lifecycle.rundir.elastic`: what torchrun reads of a failed rank (its error file).
"""
