"""A plain megatron-core GPT-MoE training loop that adopts lifecycle in a few lines (marked ``# lifecycle``).

The trainer owns everything: ``init_process_group``, ``initialize_model_parallel``, the GPTModel, megatron's DDP
and optimizer, the schedule call. lifecycle adds warmup of every group, the watchdog (a hang names the stuck
rank within the step deadline), learned deadlines, the zero-token guard, committed checkpoints and resume,
preemption (SIGTERM: save, then leave with 0) and the ordered teardown::

    torchrun --standalone --nproc-per-node 4 examples/own_loop/megatron_core_loop.py --ep 2 --steps 8 \\
        -- run.dir=runs/own-loop checkpoint.every_steps=4

Everything after ``--`` is a lifecycle override (the same as ``lifecycle run``'s). Run the same command again
and it resumes from the last committed checkpoint. ``--own-save`` keeps the trainer's own
``dist_checkpointing.save`` and wraps it in ``job.checkpoint(step, path)`` instead of lifecycle's checkpoints.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import time

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

import lifecycle  # lifecycle

VOCAB, SEQ, HIDDEN, EXPERTS = 64, 16, 64, 4


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--own-save", action="store_true", help="the trainer saves; lifecycle wraps it")
    p.add_argument("--freeze", default="", help="RANK:STEP: that rank's step never ends (a hang, for the tests)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
    p.add_argument("--setup-s", type=float, default=0.0, help="seconds of set-up after attach (data, load_checkpoint)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate after every N-th step, in job.phase('eval')")
    p.add_argument("--eval-s", type=float, default=0.0, help="seconds one evaluation takes")
    p.add_argument("--own-sigterm", action="store_true", help="the trainer's own SIGTERM handler, set before attach")
    p.add_argument("--raise-at", default="", help="RANK:STEP: the trainer's own code raises there (for the tests)")
    p.add_argument("--explicit-close", action="store_true", help="attach ... job.close() instead of `with`")
    args, rest = p.parse_known_args()
    return args, [r for r in rest if r != "--"]


def build(args: argparse.Namespace) -> tuple[list[DistributedDataParallel], object, TransformerConfig]:
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=2 * HIDDEN, num_attention_heads=4,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=2 * HIDDEN, moe_router_topk=2, moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep, sequence_parallel=args.tp > 1,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False, add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                   position_embedding_type="learned_absolute")
    if torch.cuda.is_available():
        gpt = gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)]
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, params_dtype=torch.float32,
                                                       clip_grad=1.0), model)
    return model, optimizer, config


def batch(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1009 + dp_rank)
    seq = (torch.randint(0, VOCAB, (2, 1), generator=gen) + torch.arange(SEQ + 1)) % VOCAB
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {"tokens": seq[:, :-1].to(device), "labels": seq[:, 1:].to(device),
            "position_ids": torch.arange(SEQ).expand(2, -1).to(device)}


def forward_step(data, model):  # type: ignore[no-untyped-def]
    b = next(data)
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return out, lambda per_token: (per_token.float().mean(), {"loss": per_token.float().mean().detach()})


def train_step(model: list[DistributedDataParallel], optimizer, step: int) -> float:  # type: ignore[no-untyped-def]
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter([batch(step, ps.get_data_parallel_rank())])],
        model=model, num_microbatches=1, seq_length=SEQ, micro_batch_size=2, forward_only=False)
    optimizer.step()
    loss = torch.stack([d["loss"] for d in losses]).mean().reshape(1)
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / ps.get_data_parallel_world_size()


def main() -> None:
    args, overrides = parse()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Without Transformer Engine (and on a CPU) megatron-core 0.16.1's MoE and dist_checkpointing need a small
    # compatibility layer; on a GPU it only fixes the MoE router's missing te_general_gemm.
    from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep)
    overrides = [f"parallelism.tp={args.tp}", f"parallelism.ep={args.ep}", *overrides]
    if args.own_sigterm:
        own_sigterm_handler()
    atexit.register(note, "atexit")  # the trainer's atexit handlers run too, whatever happened
    try:
        if args.explicit_close:  # the form of a trainer whose loop is not one block
            job = lifecycle.attach(overrides=overrides)  # lifecycle
            train(job, args)
            job.close()  # lifecycle: the policy's teardown (the trainer's groups are left to it)
        else:
            with lifecycle.attach(overrides=overrides) as job:  # lifecycle: policy, warmup, watchdog
                train(job, args)
    finally:
        note("finally")  # the trainer's own clean-up runs whatever happened
    dist.destroy_process_group()  # the trainer's own group, destroyed by the trainer after lifecycle closed
    note("destroyed")


def train(job: lifecycle.Job, args: argparse.Namespace) -> None:
    time.sleep(args.setup_s)  # the trainer's set-up (data iterators, load_checkpoint): watchdog.deadlines.setup
    model, optimizer, config = build(args)
    freeze_rank, _, freeze_step = args.freeze.partition(":")
    raise_rank, _, raise_step = args.raise_at.partition(":")
    if args.own_save:
        own_loop_with_own_save(job, model, optimizer, args)
        return
    job.watch(model, optimizer)  # lifecycle: zero-token guard, DDP spans, checkpoints + resume
    for step in job.steps(args.steps):  # lifecycle: one step span each; checkpoints, stop flag between
        if args.freeze and dist.get_rank() == int(freeze_rank) and step == int(freeze_step):
            time.sleep(3600)  # the trainer's own step hangs: lifecycle names this rank and step
        if args.raise_at and dist.get_rank() == int(raise_rank) and step == int(raise_step):
            raise RuntimeError(f"the trainer's own code failed at step {step}")
        time.sleep(args.step_sleep)
        loss = train_step(model, optimizer, step)
        job.report(loss=loss)  # lifecycle (optional): the loss in events and the summary
        if args.eval_every and step % args.eval_every == 0:
            with job.phase("eval"):  # lifecycle: watchdog.deadlines.eval, not the step's
                time.sleep(args.eval_s)  # the trainer's evaluation
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)


def note(what: str) -> None:
    """Leave a mark for the tests: RUN_DIR/trainer/<what>.rank_<R> (when LIFECYCLE_EXAMPLE_NOTES names a folder)."""
    folder = os.environ.get("LIFECYCLE_EXAMPLE_NOTES")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{what}.rank_{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(what)


def own_sigterm_handler() -> None:
    """The trainer's own SIGTERM handler (as Megatron-LM's --exit-signal-handler has one): lifecycle calls it after
    its own."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: note("own_sigterm"))


def own_loop_with_own_save(job: lifecycle.Job, model, optimizer, args) -> None:  # type: ignore[no-untyped-def]
    """A trainer that keeps control: its own loop and its own dist_checkpointing.save, wrapped by lifecycle."""
    from pathlib import Path

    job.watch(model, checkpoints=False)  # lifecycle: zero-token guard and DDP spans; saves stay the trainer's
    save_dir = Path(job.run_dir) / "own_checkpoints"
    for step in range(1, args.steps + 1):
        with job.step(step):  # lifecycle: the step span and its deadline
            job.report(loss=train_step(model, optimizer, step))
        decision = job.boundary(step)  # lifecycle: stop flag, barriers; save says the cadence is due
        if decision.save or decision.stop or step == args.steps:
            folder = save_dir / f"iter_{step:07d}"
            with job.checkpoint(step, path=folder):  # lifecycle: deadline, agreement off the default group, trackers
                folder.mkdir(parents=True, exist_ok=True)
                dist_checkpointing.save({"model": model[0].module.sharded_state_dict()}, str(folder))
        if decision.stop:
            break


if __name__ == "__main__":
    main()
