"""What the watchdog learned, saved with each committed checkpoint and loaded at resume.

``lifecycle_learned.json`` in the checkpoint folder (digested and pruned with it): the adaptive deadlines' state
(``watchdog.deadlines.step/checkpoint: auto``: the recent window, the agreed value), the world size and the layout
it was learned at, and the attempt that learned it. A restarted attempt resumes with the learned deadline from its
first step instead of the static one for ``calibration_steps`` steps — the moment a flaky node is most likely to
hang again. Another world size or layout keeps the static value until recalibrated, and says so (``deadline``
event). The straggler check compares ranks with each other in its window and keeps no baseline to save.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.jsontypes import JsonDict
from lifecycle.rundir import safeio

if TYPE_CHECKING:
    from lifecycle.context import RunContext

log = logging.getLogger(__name__)

NAME = "lifecycle_learned.json"
FORMAT = 1


def _layout(ctx: RunContext) -> JsonDict:
    from lifecycle.checkpoint.binding import layout

    return layout(ctx.policy, ctx.world_size, own_loop=ctx.own_loop)


def write(ctx: RunContext, folder: Path) -> bool:
    """Rank 0, before the manifest: the learned state into ``folder`` (nothing when no deadline is ``auto``)."""
    if not ctx.deadlines.learned:
        return False
    data = {"format": FORMAT, "attempt": ctx.attempt, "step": ctx.step, "layout": _layout(ctx),
            "deadlines": {phase: model.state() for phase, model in ctx.deadlines.learned.items()}}
    safeio.write_text(folder / NAME, json.dumps(data, indent=1) + "\n", fsync=True)
    return True


def load(ctx: RunContext, folder: Path) -> None:
    """Every rank, after the resume loaded ``folder``: continue the adaptive deadlines from what was learned, or
    say why they start over (a ``deadline`` event per phase either way)."""
    if not ctx.deadlines.learned:
        return
    data = safeio.try_json(folder / NAME, limit=1 << 22)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return  # a checkpoint from before this was saved, or not one lifecycle wrote: calibrate as usual
    source = f"{folder.name} (learned in attempt {data.get('attempt')})"
    then, now = data.get("layout"), _layout(ctx)
    saved = data.get("deadlines") if isinstance(data.get("deadlines"), dict) else {}
    for phase, model in ctx.deadlines.learned.items():
        # a checkpoint saved before the step deadline had one name keeps it under "train"
        state = saved.get(phase, saved.get("train") if phase == "step" else None) if isinstance(saved, dict) else None
        if then != now:
            how = (f"static {model.static_s:g}s: the deadline learned in {source} was for {_fmt(then)}, this run is "
                   f"{_fmt(now)}; recalibrating")
            ctx.events.instant("deadline", deadline=phase, seconds=model.static_s, how=how, adaptive=False,
                               source="static")
            log.warning("%s deadline: %s", phase, how)
            continue
        if isinstance(state, dict) and model.restore(state, source):
            ctx.events.instant("deadline", deadline=phase, seconds=round(model.effective(), 4),
                               how=model.derivation().text, adaptive=True, source="checkpoint")


def _fmt(layout: object) -> str:
    if not isinstance(layout, dict):
        return "an unknown layout"
    return f"world size {layout.get('world_size')} (" + " ".join(
        f"{k}={v}" for k, v in layout.items() if k != "world_size") + ")"
