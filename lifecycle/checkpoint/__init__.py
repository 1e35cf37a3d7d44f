"""Checkpoint folders and files: the directory's rules (:mod:`~lifecycle.checkpoint.ckptdir`), what a checkpoint
is bound to (:mod:`~lifecycle.checkpoint.binding`), per-rank files (:mod:`~lifecycle.checkpoint.local_files`) and the
learned deadlines saved with one (:mod:`~lifecycle.checkpoint.learned`). Internal. The checkpoint phase that commits
them is :mod:`lifecycle.phases.checkpoint`; resume, the memory tier and the no-progress verdict live in
:mod:`lifecycle.recovery`; the megatron save itself lives in :mod:`lifecycle.backends.megatron`.
"""
