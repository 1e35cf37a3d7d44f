"""Read the inputs, decide, and present the verdict: as JSON with stable keys, or as a few human lines.

JSON keys (stable): ``culprits`` (global ranks), ``suspects``, ``hosts``, ``group`` ({name, desc, ranks} or null),
``dimension``, ``op``, ``seq`` (the op's sequence number on its group), ``step`` (the step after the last
iteration the job logged, when it logs Megatron's ``iteration N/ M`` lines), ``stage``, ``cause``, ``detail``, ``evidence`` (file:line of each line
used), ``missing`` (what evidence would settle it), ``prevent`` ([{key, value, why}]), ``inputs`` (files, lines,
lines used, lines skipped, files skipped, unattributed lines, dumps and how their rank was read), ``notes``.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lifecycle.diagnose import dumps, files, logs, prevent, sources, verdict, waits
from lifecycle.diagnose.facts import Evidence
from lifecycle.errors import UnusableInput
from lifecycle.jsontypes import JsonDict

Layout = dict[str, list[list[int]]]


@dataclass
class Result:
    """The verdict with the evidence it was decided from."""

    verdict: verdict.Verdict
    evidence: Evidence
    graph: waits.Graph
    layout: Layout | None = None

    def as_json(self) -> JsonDict:
        v, ev = self.verdict, self.evidence
        group = verdict.as_json_group(ev, self.graph, v)
        dim = prevent.dimension(group["desc"], group["ranks"], self.layout) if group else None
        return {
            "culprits": v.culprits, "suspects": v.suspects, "hosts": v.hosts or _hosts(ev, v.culprits),
            "group": group, "dimension": dim, "op": v.op, "seq": v.seq, "step": v.step, "stage": v.stage,
            "cause": v.cause, "detail": v.detail, "evidence": v.evidence, "missing": v.missing,
            "prevent": prevent.keys(v.cause, v.stage, dim), "inputs": self._inputs(), "notes": ev.notes[:20],
        }

    def _inputs(self) -> JsonDict:
        ev = self.evidence
        return {"files": ev.files, "skipped_files": ev.skipped_files, "lines": ev.lines,
                "lines_used": ev.used_lines, "lines_skipped": max(ev.lines - ev.used_lines, 0),
                "unattributed_lines": ev.unattributed, "world_size": ev.world,
                "dumps": {str(r): {"file": d.where, "version": d.version, "rank_from": d.rank_from}
                          for r, d in sorted(ev.dumps.items())}}

    def render(self) -> str:
        return render(self.as_json())


def _hosts(ev: Evidence, ranks: list[int]) -> list[str]:
    return sorted({ev.hosts[r] for r in ranks if r in ev.hosts})


def diagnose(paths: list[str], *, layout: Layout | None = None) -> Result:
    """The verdict on the files and folders in ``paths`` (RunDirError naming a file that cannot be used)."""
    inputs, skipped = files.collect(paths)
    ev = Evidence(files=len(inputs), skipped_files=skipped, layout=layout)
    if layout and layout.get("world"):
        ev.see_world(len(layout["world"][0]))
    reader = logs.Reader(ev)
    for item in inputs:  # logs first: torchrun's summary maps error files to ranks
        if item.kind == "log":
            logs.read(str(item.path), files.read_head(item.path), reader)
        elif item.kind == "jsonl":
            ev.skipped_files += 1
    reader.finish()
    unusable: list[UnusableInput] = []
    for item in inputs:
        try:
            if item.kind == "pickle":
                _pickle(item, ev)
            elif item.kind == "json" and not sources.read_json(item.path, reader):
                ev.skipped_files += 1
        except UnusableInput as exc:  # one unusable input never ends the run; a hostile one still does
            unusable.append(exc)
            ev.skipped_files += 1
            ev.unusable.append(f"{exc} — rename it to end in its rank (fr_trace_rank_<R>) to use it")
            if len(ev.notes) < 20:
                ev.notes.append(f"skipped: {exc}")
    if unusable and not (ev.dumps or ev.facts or ev.present):
        raise unusable[0]  # nothing usable is left: exit 2, naming the file
    reader.judge_roots()
    sources.keep_current_report(ev)
    g = waits.graph(ev)
    return Result(verdict.decide(ev, g), ev, g, layout)


def _pickle(item: files.Input, ev: Evidence) -> None:
    value = dumps.load(item.path, "pickle", named=item.named)
    if value is None:
        ev.skipped_files += 1
        if len(ev.notes) < 20:
            ev.notes.append(f"{item.path}: a pickle that is no Flight Recorder dump (a checkpoint?): skipped, "
                            f"nothing of it imported or run")
        return
    sources.add_dump(ev, dumps.summarize(value, str(item.path), item.path))


def render(data: JsonDict) -> str:
    """The verdict as a few lines a person reads first."""
    culprits = data["culprits"]
    group = data["group"] or {}
    where = f" in {data['op'] or 'an op'} #{data['seq']}" if data["seq"] is not None else ""
    gname = f" on group {group.get('name')}" + (f" ({group['desc']})" if group.get("desc") else "") if group else ""
    dim = f", dimension {data['dimension']}" if data["dimension"] else ""
    head = (f"culprit rank(s) {_ranks(culprits)}: {data['cause']}{where}{gname}{dim}" if culprits
            else f"no culprit named: the evidence does not decide (cause seen: {data['cause'] or 'unknown'})")
    out = [f"lifecycle diagnose: {head}", f"  stage: {data['stage'] or 'unknown'}"
           + (f" (step {data['step']})" if data["step"] else "")]
    if data["detail"]:
        out.append(f"  why: {data['detail'][:400]}")
    if data["suspects"]:
        out.append(f"  suspects (not decided between): {_ranks(data['suspects'])}")
    if data["hosts"]:
        out.append(f"  hosts: {', '.join(data['hosts'][:8])}")
    out += [f"  evidence: {w}" for w in data["evidence"][:12]]
    out += [f"  missing: {m}" for m in data["missing"]]
    out += [f"  prevent: {k['key']}={k['value']}  ({k['why']})" for k in data["prevent"]]
    i = data["inputs"]
    out.append(f"  read {i['files']} file(s), {i['lines']} line(s): {i['lines_used']} used, {i['lines_skipped']} "
               f"skipped as unknown; {len(i['dumps'])} dump(s); {i['skipped_files']} file(s) skipped")
    return "\n".join(out)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:32])) + (f" (+{len(ranks) - 32})" if len(ranks) > 32 else "")


def layout_of(overrides: list[str], config_dir: str | None, config_name: str, world: int) -> Layout:
    """Every group of the policy's layout at ``world`` ranks: name -> its rank lists (as ``explain`` computes)."""
    from lifecycle.machine.explain import layout_for
    from lifecycle.policy.load import load

    # only the layout matters here: the policy's model (its heads, its experts) must not refuse a foreign job's tp
    neutral = ["train.kind=synthetic", "~train.options"]
    lay = layout_for(load([*neutral, *overrides], config_dir=config_dir, config_name=config_name), world)
    names = ["tp", "pp", "dp", "cp", "ep", "etp", "edp", "dp_cp", "mp", "tp_dp", "tp_ep", "world"]
    out: Layout = {}
    for name in names:
        if lay.exists(name):
            out[name] = [sorted(g) for g in lay.groups(name)]
    return out


def as_path(name: str) -> Path:
    return Path(name)
