"""Checkpoint folders and files: the directory's rules (:mod:`~lifecycle.checkpoint.ckptdir`), what a checkpoint
is bound to (:mod:`~lifecycle.checkpoint.binding`), per-rank files (:mod:`~lifecycle.checkpoint.local_files`), the
learned deadlines saved with one (:mod:`~lifecycle.checkpoint.learned`) and the progress a run directory shows
(:mod:`~lifecycle.checkpoint.progress`). Internal. The checkpoint phase that commits them is
:mod:`lifecycle.phases.checkpoint`, resume :mod:`lifecycle.phases.resume`; the megatron save itself lives in
:mod:`lifecycle.backends.megatron`.
"""
