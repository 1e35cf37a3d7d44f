"""A PNG Gantt chart of the phases of every rank (matplotlib: the optional ``plot`` extra).

Uses matplotlib's object API with the Agg canvas (no pyplot, no global figure state, no display needed).
Rows are ranks (rank 0 on top), bars are phases (a failure teardown in red), cut phases are hatched, thin
ticks mark train steps, and checkpoint commits, resumes, failures, fault drills, hang reports and exits are
markers. The start-up before the process group exists (Python imports: seconds that say nothing about the
job) is folded: the time axis starts shortly before the first ``init_process_group`` and says how much it hid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lifecycle.obs.spans import phase_of, rank_spans

COLORS = {"init": "#8da0cb", "warmup": "#fc8d62", "train": "#66c2a5", "checkpoint": "#7b3294",
          "teardown": "#b3b3b3"}
FAILURE_COLOR = "#d7191c"
MANY_RANKS = 64  # above this, exits are not marked (a clean exit per row is noise; failures still are)
# instant name -> (marker, color, legend label); names containing "hang" use the hang entry
MARKERS = {"failure": ("X", FAILURE_COLOR, "failure"), "fault_drill": ("v", "#ff7f00", "fault drill"),
           "hang": ("D", "#e41a1c", "hang report"), "exit": ("|", "black", "exit"),
           "teardown_deadline": ("P", FAILURE_COLOR, "teardown deadline")}
# span name (its end) -> marker: what happened to the job's state
SPAN_MARKERS = {"commit": ("s", "#7b3294", "checkpoint committed"), "resume": ("^", "#1a9641", "resumed")}
FOLD_MIN_S = 1.0  # fold a start-up longer than this
MAX_TICKS = 400  # step ticks drawn per rank (every k-th step beyond)


def available() -> bool:
    """Whether matplotlib can be imported (the optional ``plot`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _marker(name: str) -> tuple[str, str, str] | None:
    return MARKERS["hang"] if "hang" in name else MARKERS.get(name)


def _size(n_ranks: int) -> tuple[float, float]:
    return 10.0, min(max(1.4 + 0.32 * n_ranks, 2.6), 14.0)


SHADES = {"lost": "#d73027", "detection": "#fc8d59", "restore": "#984ea3", "checkpoint": "#4575b4",
          "relaunch": "#000000", "teardown": "#8c510a", "startup": "#969696"}
"""The goodput buckets shaded behind the bars (productive time and other are left clear)."""


def plot(events: dict[int, list[dict[str, Any]]], path: Path, *, title: str = "", dpi: int = 100,
         shading: list[tuple[int, int, str]] | None = None) -> Path:
    """Draw the phases of every rank to ``path`` (PNG) and return it; ``shading``: goodput's ``(start_us, end_us,
    bucket)`` pieces, shaded over the time axis (:data:`SHADES`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    first = min(e["t"] for evs in events.values() for e in evs)
    t0, folded = _origin(events, first)
    fig = Figure(figsize=_size(len(events)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars: dict[tuple[str, bool], list[tuple[int, float, float]]] = {}
    points: dict[tuple[str, str, str], list[tuple[float, int]]] = {}
    ticks: list[tuple[float, int]] = []
    for rank, evs in sorted(events.items()):
        steps = []
        for span in rank_spans(rank, evs):
            phase = phase_of(span)
            start, end = max(span.start_us, t0), span.start_us + span.dur_us
            if phase is not None and end > t0:
                label = f"{phase} (failure path)" if span.begin.get("failure") else phase
                bars.setdefault((label, span.cut), []).append((rank, (start - t0) / 1e6, (end - start) / 1e6))
            elif span.name == "step" and not span.cut:
                steps.append((end - t0) / 1e6)
            elif span.name in SPAN_MARKERS and not span.cut and span.fields.get("outcome", "ok") == "ok":
                points.setdefault(SPAN_MARKERS[span.name], []).append(((end - t0) / 1e6, rank))
        every = max(1, len(steps) // MAX_TICKS)
        ticks.extend((x, rank) for x in steps[::every])
        for e in evs:
            m = _marker(e["name"]) if e["kind"] == "instant" else None
            if m is not None and not (m[2] == "exit" and len(events) > MANY_RANKS):
                points.setdefault(m, []).append(((max(e["t"], t0) - t0) / 1e6, rank))
    handles = _draw(ax, bars, points)
    if shading:
        last = max(e["t"] for evs in events.values() for e in evs)
        handles.update(_shade(ax, shading, t0, last))
    if ticks:
        xs, ys = zip(*ticks, strict=True)
        handles["train step"] = ax.scatter(xs, ys, marker="|", color="#1b7837", s=30, linewidths=0.6, zorder=2)
    _axes(ax, sorted(events), title)
    if folded >= FOLD_MIN_S:
        ax.set_xlabel(f"seconds since the first init_process_group (start-up before it, {folded:.1f}s of imports, "
                      f"folded)", fontsize=9)
        ax.axvline(0.0, color="black", linestyle=":", linewidth=0.8)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import io

    from lifecycle.rundir import safeio

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    safeio.write_bytes(path, buf.getvalue())  # replaced atomically; a device or FIFO there is refused
    return path


def _origin(events: dict[int, list[dict[str, Any]]], first: int) -> tuple[int, float]:
    """(the time axis origin, the seconds of start-up folded away before it)."""
    starts = [e["t"] for evs in events.values() for e in evs
              if e["kind"] == "begin" and e["name"] == "init_process_group"]
    if not starts:
        return first, 0.0
    folded = (min(starts) - first) / 1e6
    return (min(starts), folded) if folded >= FOLD_MIN_S else (first, 0.0)


def _draw(ax: Any, bars: dict[tuple[str, bool], list[tuple[int, float, float]]],
          points: dict[tuple[str, str, str], list[tuple[float, int]]]) -> dict[str, Any]:
    """One barh call per (phase, cut) and one scatter per marker: fast at thousands of ranks."""
    from matplotlib.patches import Patch

    handles: dict[str, Any] = {}
    order = {p: i for i, p in enumerate(COLORS)}
    for (label, cut), rows in sorted(bars.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0])):
        phase = label.split(" ", 1)[0]
        color = FAILURE_COLOR if label.endswith("(failure path)") else COLORS.get(phase, "#999999")
        ys, lefts, widths = zip(*rows, strict=True)
        h = ax.barh(ys, widths, left=lefts, height=0.6, color=color, edgecolor="black" if cut else "none",
                    hatch="///" if cut else None, linewidth=0.6)
        handles.setdefault(label, h)
    if any(cut for _, cut in bars):
        handles["cut (no end: rank died)"] = Patch(facecolor="white", edgecolor="black", hatch="///")
    for (marker, color, label), xy in points.items():
        xs, ys = zip(*xy, strict=True)
        handles[label] = ax.scatter(xs, ys, marker=marker, color=color, s=60, zorder=3)
    return handles


def _shade(ax: Any, pieces: list[tuple[int, int, str]], t0: int, last: int) -> dict[str, Any]:
    """The badput buckets as light vertical bands behind the bars (pieces narrower than 1/1500 of the axis left
    out: they would not show); one legend entry per bucket drawn."""
    from matplotlib.patches import Patch

    handles: dict[str, Any] = {}
    least = max(last - t0, 1) / 1500
    for lo, hi, bucket in pieces:
        color = SHADES.get(bucket)
        lo, hi = max(lo, t0), min(hi, last)
        if color is None or hi - lo < least:
            continue
        ax.axvspan((lo - t0) / 1e6, (hi - t0) / 1e6, color=color, alpha=0.13, linewidth=0, zorder=0)
        handles.setdefault(f"goodput: {bucket}", Patch(facecolor=color, alpha=0.3))
    return handles


def _axes(ax: Any, ranks: list[int], title: str) -> None:
    step = max(1, len(ranks) // 32)
    shown = ranks[::step]
    ax.set_yticks(shown)
    ax.set_yticklabels([f"rank {r}" for r in shown], fontsize=8)
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    ax.set_xlabel("seconds since the first event", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title, fontsize=10)
