"""The CLI as users run it: subprocesses, exit codes, output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from lifecycle.policy import installed
from lifecycle.policy import load as L
from tests.helpers import ROOT, run_cli


def test_validate_ok_one_line() -> None:
    proc = run_cli("validate")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ok: ") and "ep=2" in lines[0]


def test_validate_lists_every_error() -> None:
    proc = run_cli("validate", "train.steps=-1", "warmup.ops=[nope]", "checkpoint.keep_last=x")
    assert proc.returncode == 2
    assert "3 error(s)" in proc.stderr and "Traceback" not in proc.stderr
    for path in ("train.steps:", "warmup.ops.0:", "checkpoint.keep_last:"):
        assert path in proc.stderr


def test_validate_imports_neither_torch_nor_megatron() -> None:
    code = ("import sys; from lifecycle.cli import main; rc = main(['validate']); "
            "assert rc == 0; bad = [m for m in ('torch', 'megatron') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_module_entry_point_and_usage_error() -> None:
    proc = run_cli("frobnicate")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_explain_text_without_world_size() -> None:
    proc = run_cli("explain", "preset=moe_large")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for phase in ("init", "warmup", "train", "checkpoint", "teardown"):
        assert f"\n{phase}" in out
    assert "warm:all_to_all" in out and "barrier:after_init" in out and "inter_dist_opt" in out


def test_explain_json_is_the_plan() -> None:
    proc = run_cli("explain", "--json", "train.steps=0")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert [a["op"] for a in info["plan"]["train"]] == ["stop_flag", "sequence_check"]
    assert info["plan"]["checkpoint"] == []
    assert [a["op"] for a in info["plan"]["init"]][:4] == [
        "import:backend", "init_process_group", "initialize_model_parallel", "check_policy_hash"]


def test_schema_is_a_json_schema_that_accepts_resolved_policies() -> None:
    proc = run_cli("schema")
    assert proc.returncode == 0
    schema = json.loads(proc.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for preset in ("dense", "moe", "moe_large"):
        validator.validate(L.to_plain(L.load([f"preset={preset}"]).policy))
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"warmup": {"ops": ["nope"]}})


def test_resolved_policy_yaml_validates_from_disk(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(L.to_plain(L.load([]).policy)))
    proc = run_cli("validate", "--config-dir", str(tmp_path), "--config-name", "mine")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("override,expected", [
    ("checkpoint=sync", "checkpoint: unknown option of config group checkpoint; did you mean async? its options "
                        "are: async, off"),
    ("warmup=ful", "did you mean full? its options are: full, minimal"),
    ("teardown=fst", "did you mean fast? its options are: fast"),
    ("checkpoint.keep_lst=5", "checkpoint.keep_lst: unknown key; did you mean checkpoint.keep_last"),
    ("+checkpoint.keep_lst=5", "checkpoint.keep_lst: unknown key; did you mean checkpoint.keep_last"),
    ("presets=moe", "did you mean preset (config group: preset=OPTION)"),
    ("checkpoint.async=yes", "checkpoint.async: Input should be a valid boolean (got 'yes')"),
    ("parallelism.tp=8", "parallelism.tp: must divide train.options.heads (4); megatron would refuse the model"),
    ("parallelism.pp=3", "train.options.num_layers: must be divisible by pp x vpp = 3 x 1 = 3"),
])
def test_config_groups_keys_and_booleans_are_strict(override: str, expected: str) -> None:
    from lifecycle.cli import main

    proc = run_cli("validate", override)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert "To append to your config use" not in proc.stderr and "Traceback" not in proc.stderr
    assert main(["validate", "checkpoint=async", "warmup=full", "teardown=fast"]) == 0


def test_validate_print_is_the_resolved_policy_as_yaml() -> None:
    proc = run_cli("validate", "--print", "preset=moe_large", "checkpoint.keep_last=7")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["checkpoint"]["keep_last"] == 7 and data["parallelism"]["ep"] == 4
    assert L.validate(data).checkpoint.keep_last == 7


@pytest.mark.timeout(60)
def test_resume_required_without_a_checkpoint_is_refused_before_any_rank_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("run", f"run.dir={tmp_path / 'run'}", "checkpoint.resume=required", timeout=50)
    assert proc.returncode == 2 and "checkpoint.resume: is required but" in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "events").exists()  # no rank started


def test_explain_prints_the_communicator_bill_and_its_json() -> None:
    nccl = ("preset=moe", "parallelism.ep=4", "distributed.backend=nccl")  # NCCL's bill, asked on a CPU machine
    proc = run_cli("explain", "-w", "16", "--ranks-per-node", "4", *nccl, "+distributed.nccl_env.NCCL_BUFFSIZE=2097152")
    assert proc.returncode == 0, proc.stderr
    assert "communicators (NCCL estimate, device memory, rank 0, 4 ranks per node)" in proc.stdout
    assert "same ranks, separate communicators: world, dp, dp_cp, tp_dp, tp_dp_cp, intra_dist_opt" in proc.stdout
    # megatron-core 0.19+ norms over tp_ep_pp_egtp, so its tp_ep_pp is never used either
    never = "tp_dp, tp_dp_cp, tp_ep_pp, intra_dist_opt" if installed.gtp_groups() else "tp_dp, tp_dp_cp, intra_dist_opt"
    assert f"never used by the job's collectives: {never}: " in proc.stdout
    info = json.loads(run_cli("explain", "-w", "16", "--json", *nccl).stdout)
    smaller = json.loads(run_cli("explain", "-w", "16", "--json", *nccl,
                                 "+distributed.nccl_env.NCCL_BUFFSIZE=2097152").stdout)
    assert smaller["comm_memory"]["total_bytes"] < info["comm_memory"]["total_bytes"]
    assert info["nccl_env"] == {"NCCL_RUNTIME_CONNECT": "0"} and info["comm_memory"]["backend"] == "nccl"
    # warmup.groups: used creates fewer communicators: at world 16, ep 4 a third less memory
    used = json.loads(run_cli("explain", "-w", "16", "--json", *nccl, "warmup.groups=used").stdout)["comm_memory"]
    assert used["total_bytes"] < 0.8 * info["comm_memory"]["total_bytes"]
    # The backend the run will use: gloo on this machine (no NVIDIA driver), whose bill is host memory
    gloo = json.loads(run_cli("explain", "-w", "16", "--json", "preset=moe", "parallelism.ep=4",
                              "distributed.backend=gloo").stdout)["comm_memory"]
    assert gloo["backend"] == "gloo" and 0 < gloo["total_bytes"] < 64 * 2**20
    assert any(c["group"] == "dp_gloo" for c in gloo["communicators"])  # a gloo twin is a communicator like any


def test_a_communicator_budget_below_the_estimate_stops_the_run_before_any_rank_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # --oversubscribe: this machine has no GPU for the nccl ranks (refused first without it: tests/unit/test_capacity)
    proc = run_cli("run", "--nproc", "4", "--oversubscribe", f"run.dir={run_dir}",
                   "distributed.comm_memory_budget_gib=0.5", "distributed.backend=nccl")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "distributed.comm_memory_budget_gib: rank 0's nccl communicators would take" in proc.stderr
    assert "over the budget; largest: " in proc.stderr and "NCCL_BUFFSIZE" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run_dir / "events").exists()  # no rank started
    # Smaller buffers and channels bring the same job under the same budget (validated, not run here).
    from lifecycle.machine.preflight import check_comm_budget
    from lifecycle.policy.load import validate

    small = validate({"distributed": {"comm_memory_budget_gib": 0.5, "backend": "nccl",
                                      "nccl_env": {"NCCL_BUFFSIZE": 1 << 20, "NCCL_MAX_NCHANNELS": 2}},
                      "parallelism": {"ep": 2}})
    check_comm_budget(small, 4, 4)
    # On gloo (this machine's backend) the bill is host memory, a few MiB: a budget below it is refused as well
    proc = run_cli("run", "--nproc", "4", f"run.dir={run_dir}", "distributed.comm_memory_budget_gib=0.0001")
    assert proc.returncode == 2 and "rank 0's gloo communicators would take 0.00" in proc.stderr, proc.stderr
    assert "shrink with warmup.groups: used" in proc.stderr and not (run_dir / "events").exists()


def test_verdict_exits_with_the_code_the_ranks_ended_with(tmp_path: Path) -> None:
    """What a scheduler acts on under torchrun (which exits 1 for any failed worker)."""
    events = tmp_path / "run" / "events"
    events.mkdir(parents=True)
    for rank, code in ((0, 0), (1, 4)):
        lines = [{"t": 1, "rank": rank, "phase": "train", "kind": "instant", "name": "attempt", "attempt": 1},
                 {"t": 2, "rank": rank, "phase": "teardown", "kind": "instant", "name": "exit", "exit_code": code}]
        (events / f"rank_{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    proc = run_cli("verdict", str(tmp_path / "run"))
    assert proc.returncode == 4 and "exit 4: rank 1" in proc.stdout, proc.stdout + proc.stderr
    (events / "rank_1.jsonl").write_text((events / "rank_0.jsonl").read_text().replace('"rank": 0', '"rank": 1'))
    proc = run_cli("verdict", str(tmp_path / "run"))
    assert proc.returncode == 0 and "all 2 ranks exited 0" in proc.stdout
    proc = run_cli("verdict", str(tmp_path))
    assert proc.returncode == 2 and "not a lifecycle run directory" in proc.stderr and "Traceback" not in proc.stderr


def test_validate_refuses_async_strategy_nvrx_without_the_package() -> None:
    from lifecycle.policy import installed

    if installed.version(installed.NVRX) is not None:
        pytest.skip("nvidia-resiliency-ext is installed in this environment")
    proc = run_cli("validate", "checkpoint.async_strategy=nvrx")
    assert proc.returncode == 2, proc.stderr
    assert "checkpoint.async_strategy: nvrx needs nvidia-resiliency-ext, which is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert run_cli("validate", "checkpoint.async_strategy=auto").returncode == 0


def test_run_refuses_an_nvrx_that_megatron_core_cannot_import_before_any_rank(tmp_path: Path) -> None:
    """megatron-core 0.18+ beside nvidia-resiliency-ext < 0.6 (what pip picks where glibc is older than 2.39) fails at
    ``import megatron.core``: said before launch with both versions and the fix (stand-in packages' metadata)."""
    for name, version in (("megatron_core", "0.19.2"), ("nvidia_resiliency_ext", "0.4.1")):
        info = tmp_path / "site" / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    proc = run_cli("run", "--nproc", "2", f"run.dir={tmp_path / 'run'}", "train.steps=2",
                   env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "megatron-core 0.19.2 cannot be imported beside nvidia-resiliency-ext 0.4.1" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "logs").exists()
