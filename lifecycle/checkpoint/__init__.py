"""Checkpoints: the directory's rules (:mod:`~lifecycle.checkpoint.ckptdir`), the commit protocol
(:mod:`~lifecycle.checkpoint.commit`) and resume (:mod:`~lifecycle.checkpoint.resume`). Internal; the megatron
save itself lives in :mod:`lifecycle.backends.megatron`.
"""

from lifecycle.checkpoint.commit import ASYNC_COMMIT, PendingSave, TrainerSave, finish_pending, plan, save
from lifecycle.checkpoint.resume import resume

__all__ = ["ASYNC_COMMIT", "PendingSave", "TrainerSave", "finish_pending", "plan", "resume", "save"]
