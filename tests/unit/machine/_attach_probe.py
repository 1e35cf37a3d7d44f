"""Run by test_job.py in its own process: one gloo rank exercises the Job's public face; prints JSON."""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch

import lifecycle

OVR = sys.argv[1:]
out: dict[str, object] = {}


def expect(name: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
        out[name] = None
    except lifecycle.LifecycleError as exc:
        out[name] = [type(exc).__name__, str(exc), exc.exit_code]


def train(job: lifecycle.Job, model: torch.nn.Module, opt: torch.optim.Optimizer, total: int) -> list[int]:
    done = []
    for step in job.steps(total):
        loss = model(torch.ones(2, 4) * step).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        job.report(loss=float(loss))
        done.append(step)
    return done


port = os.environ.pop("PORT")
for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
    os.environ.pop(name, None)
expect("no_env", lambda: lifecycle.attach(overrides=OVR))
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

job = lifecycle.attach(overrides=OVR)
expect("twice", lambda: lifecycle.attach(overrides=OVR))
expect("watch_non_module", lambda: job.watch("model"))
expect("watch_list_of_junk", lambda: job.watch([torch.nn.Linear(2, 2), 3]))
expect("save_unwatched", lambda: job.save(0))
expect("steps_before_watch", lambda: job.steps(3))
expect("phase_reserved_name", lambda: job.phase("step").__enter__())
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
job.watch(model, opt)
expect("watch_twice", lambda: job.watch(model, opt))
expect("steps_negative", lambda: job.steps(-1))
out["steps_done"] = train(job, model, opt, 3)
out["close"] = job.close()
out["close_again"] = job.close()
expect("steps_after_close", lambda: job.steps(5))
expect("boundary_after_close", lambda: job.boundary(1))
after_close = {"watch": lambda: job.watch(model, opt), "step": lambda: job.step(4).__enter__(),
               "report": lambda: job.report(loss=1.0), "phase": lambda: job.phase("evaluate").__enter__(),
               "save": lambda: job.save(4), "checkpoint": lambda: job.checkpoint(4).__enter__(),
               "fail": lambda: job.fail(RuntimeError("after close"))}
for call, fn in after_close.items():
    expect(f"{call}_after_close", fn)

again = lifecycle.attach(overrides=OVR)
fresh = torch.nn.Linear(4, 1)
fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.01)
again.watch(fresh, fresh_opt)
out["resumed"] = again.start_step
out["weights_restored"] = bool(torch.equal(fresh.weight, model.weight))
out["steps_again"] = train(again, fresh, fresh_opt, 5)
again.close()

# A trainer with its own default group at torch's default timeout (gloo: 30 minutes): the deadlines nobody set (eval
# here, 1800 s) fit under it, with no warning; the trainer's group stays the trainer's.
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402

dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{os.environ.pop('PORT2')}")
adopted = lifecycle.attach(overrides=OVR, run_dir="adopted")
out["adopted_deadlines"] = yaml.safe_load((adopted.run_dir / "policy.resolved.yaml").read_text())["watchdog"][
    "deadlines"]
adopted.close()
out["adopted_group_kept"] = dist.is_initialized()
dist.destroy_process_group()
print(json.dumps(out), flush=True)

# sys.exit(0) inside `with` is a clean close; any other exception takes the failure edge and the process leaves
# with the policy's code (rank_failed: 4) after the failure teardown.
try:
    with lifecycle.attach(overrides=OVR) as job:
        sys.exit(0)
except SystemExit:
    print("clean exit closed:", job.closed, job.exit_code, flush=True)
# The trainer's own error goes on to the trainer after lifecycle's part of the failure edge: its `finally` and
# atexit run, then the process leaves with the policy's code.
atexit.register(lambda: print("atexit ran", flush=True))
try:
    with lifecycle.attach(overrides=OVR) as job:
        raise ValueError("the trainer's own bug")
finally:
    print("finally ran:", job.closed, job.exit_code, flush=True)
