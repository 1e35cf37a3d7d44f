"""One training step with Megatron's own schedule: ``get_forward_backward_func()`` over the model chunks.

The schedule is chosen by megatron-core from ``parallel_state``: no pipelining (pp = 1), 1F1B (pp > 1), or
the interleaved 1F1B over virtual stages (vpp > 1). Between pipeline stages it sends activations and their
gradients with ``batch_isend_irecv`` on the pp group (the previous and next stage); with
``overlap_grad_reduce`` the DDP backward hooks launch each bucket's gradient reduction as soon as its last
micro-batch's gradients are in (``grad_sync_func`` per chunk), and ``finalize_model_grads`` waits for them.
The loss is computed on the last stage, averaged over micro-batches and the dp group, and broadcast over
the pp group so every rank reports the same number.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lifecycle.backends.megatron.state import TrainState

logger = logging.getLogger(__name__)


def wire_schedule(config: Any, chunks: list[Any], ddp_config: Any) -> None:
    """Hand the DDP chunks' sync hooks to the schedule, as Megatron-LM's ``setup_model_and_optimizer`` does.

    Local, no collective.
    """
    from megatron.core.distributed import finalize_model_grads

    one = len(chunks) == 1
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if one else no_sync
    if ddp_config.overlap_grad_reduce:  # align the reductions of every chunk with the schedule
        grad_sync = [c.start_grad_sync for c in chunks]
        config.grad_sync_func = grad_sync[0] if one else grad_sync
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        param_sync = [c.start_param_sync for c in chunks]
        config.param_sync_func = param_sync[0] if one else param_sync
    config.finalize_model_grads_func = finalize_model_grads


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[Any, Any]:
    """Megatron's ``forward_step_func``: one micro-batch through one chunk, and the loss function.

    A chunk without ``pre_process`` ignores the tokens (its input comes from the previous stage); one
    without ``post_process`` returns hidden states and the schedule never calls the loss function.
    """
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        # clone: the schedule divides the returned loss in place by the number of micro-batches
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def train_step(state: TrainState, batches: list[dict[str, torch.Tensor]]) -> float:
    """One training step over ``batches`` (the micro-batches of this data-parallel rank).

    Collective: every rank of the default group must call it with its own micro-batches (as many on every
    rank). Inside, in order: the schedule's send/recv of activations and gradients on the pp group;
    forward/backward collectives on the tp group (sequence-parallel gather/reduce-scatter, vocab-parallel
    cross entropy) and the ep group (``all_to_all_single`` of token counts and tokens, or all-gathers with
    the allgather dispatcher; the expert-tp group when etp > 1); the gradient reductions on the dp group
    (dense) and the expert-dp group (experts) — reduce-scatters inside each distributed-optimizer instance
    and all-reduces on the inter-instance group with ``dist_opt_instances`` > 1, from the backward hooks
    with ``overlap_grad_reduce`` —, layer-norm grads on the tp group; the grad-norm all-reduces of the
    optimizer on the model-parallel groups; the distributed optimizer's parameter all-gather (now, or in
    the next forward with ``overlap_param_gather``); last, the loss all-reduce on the dp group and its
    broadcast on the pp group. Returns the loss, identical on every rank; ``state.grad_norm`` is the global
    gradient norm the optimizer clipped with (also identical on every rank).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    o = state.spec.options
    for chunk in state.chunks:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    # Every chunk walks the same micro-batches (Megatron-LM gives each virtual stage its own iterator).
    losses = forward_backward(
        forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in state.chunks],
        model=state.chunks, num_microbatches=len(batches), seq_length=o.seq_len, micro_batch_size=o.micro_batch,
        forward_only=False)
    clear_aux_losses_tracker()  # the tracker accumulates per step; nobody reads it here
    ok, grad_norm, _ = state.optimizer.step()
    if not ok:
        logger.warning("optimizer step %d skipped (non-finite gradients)", state.step)
    state.grad_norm = float(grad_norm) if grad_norm is not None else None
    state.step += 1
    return _report_loss(losses)


def _report_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    """The step's loss on every rank: mean over micro-batches (last stage), dp-averaged, broadcast over pp.

    Collective: every rank of the dp group (all-reduce) and of the pp group (broadcast from the last stage).
    """
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron import comm_events

    # on the current GPU under NCCL (its collectives take no CPU tensor); CUDA is absent on the CPU layer
    loss = torch.zeros(1, device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    if losses:  # only the last pipeline stage has them
        loss += torch.stack([d["loss"] for d in losses]).mean()
    dp = ps.get_data_parallel_group()
    with comm_events.collective("loss_all_reduce", dp):
        dist.all_reduce(loss, group=dp)
    loss /= dist.get_world_size(dp)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        pp = ps.get_pipeline_model_parallel_group()
        with comm_events.collective("loss_broadcast", pp):
            dist.broadcast(loss, src=ps.get_pipeline_model_parallel_last_rank(), group=pp)
    return float(loss.item())


def finish_param_sync(state: TrainState) -> None:
    """Make every parameter current before it is read outside a forward (a checkpoint save).

    With ``overlap_param_gather`` the distributed optimizer's step leaves the all-gather of the updated
    parameters to the next forward's pre-hooks; Megatron-LM disables the hooks (which forces the
    gather now) around a save. Collective on each distributed-optimizer instance's dp group when
    ``overlap_param_gather`` is on; otherwise nothing to do (no collective).
    """
    if not state.overlap_param_gather:
        return
    for chunk in state.chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    for chunk in state.chunks:
        chunk.enable_forward_pre_hook()
