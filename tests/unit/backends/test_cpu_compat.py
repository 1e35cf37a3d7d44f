"""The CPU compatibility layer: what it patches, that it is idempotent, that the patches behave.

``apply_cpu_compat`` patches torch and megatron-core for the whole process and cannot be undone, so
the probes run in one fresh interpreter (not in the pytest process, whose other tests must not see a
patched torch) and report their observations as JSON; the tests below assert on that report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.conftest import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op with CUDA"), pytest.mark.megatron]
NO_CUDA = ("AssertionError", "RuntimeError")
"""What an unpatched ``torch.cuda`` call raises without a GPU: a CPU build, or a CUDA build with no driver."""

PROBE = textwrap.dedent(
    """
    import json, threading, warnings
    warnings.simplefilter("ignore")
    import torch
    from lifecycle.backends.megatron import cpu_compat as cc

    out = {}
    import sys
    import megatron.core.jit as mjit
    from megatron.core.fusions import fused_bias_dropout
    import megatron.core.package_info as mpi
    out["megatron"] = mpi.__version__
    out["jit"] = {"dynamo_imported": "torch._dynamo" in sys.modules, "inductor_imported": "torch._inductor" in sys.modules,
                  "fuser_disabled": mjit.jit_fuser is mjit.noop_decorator,
                  "fusion_is_plain": fused_bias_dropout.bias_dropout_add_fused_train.__module__ == fused_bias_dropout.__name__
                  and not hasattr(fused_bias_dropout.bias_dropout_add_fused_train, "_torchdynamo_orig_callable")}
    out["before_applied"] = cc.is_applied()
    from megatron.core.transformer.moe import moe_utils as mu  # 0.16.1 lacks it without TransformerEngine
    out["te_general_gemm_missing"] = not hasattr(mu, "te_general_gemm")
    try:
        torch.cuda.current_device()
        out["before_current_device"] = "ok"
    except Exception as err:
        out["before_current_device"] = type(err).__name__

    out["first"] = cc.apply_cpu_compat()
    patches = cc.applied_patches()
    out["patches"] = patches
    funcs = (torch.cuda.current_device, torch.Tensor.cuda)
    depth = torch._C._len_torch_function_stack()
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    norm_new = WrappedTorchNorm.__new__
    out["second"] = cc.apply_cpu_compat()
    out["idempotent"] = (cc.applied_patches() == patches
                         and funcs == (torch.cuda.current_device, torch.Tensor.cuda)
                         and torch._C._len_torch_function_stack() == depth
                         and WrappedTorchNorm.__new__ is norm_new)
    out["is_applied"] = cc.is_applied()

    out["current_device"] = str(torch.cuda.current_device())
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        event = stream.record_event()
    event.synchronize()
    out["streams_ok"] = True
    out["zeros_cuda"] = torch.zeros(2, device="cuda").device.type
    out["tensor_cuda_identity"] = (lambda t: t.cuda() is t)(torch.ones(1))

    def in_thread(box):
        try:
            torch.zeros(1, device="cuda")
            box["bare"] = "ok"
        except Exception as err:
            box["bare"] = type(err).__name__
        with cc.cuda_to_cpu_mode():
            box["with_mode"] = torch.zeros(1, device="cuda").device.type
    box = {}
    t = threading.Thread(target=in_thread, args=(box,))
    t.start(); t.join()
    out["thread"] = box

    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    out["te_general_gemm"] = repr(moe_utils.te_general_gemm)
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    out["splits_type"] = type(splits).__module__ + "." + type(splits).__name__

    from megatron.core import tensor_parallel
    def draw(seed):
        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=1, etp_rank=0,
                                                        force_reset_rng=True)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        cpu_before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        with tracker.fork("expert-parallel-rng"):
            b = torch.rand(4)
        return a, b, type(tracker).__name__, torch.equal(cpu_before, torch.get_rng_state())
    a1, b1, name, cpu_untouched = draw(5)
    a2, b2, _, _ = draw(5)
    a3, _, _, _ = draw(6)
    out["tracker"] = {"class": name, "reproducible": torch.equal(a1, a2) and torch.equal(b1, b2),
                      "streams_differ": not torch.equal(a1, b1), "seed_matters": not torch.equal(a1, a3),
                      "cpu_rng_untouched": cpu_untouched}

    from megatron.core.optimizer import clip_grads
    p = torch.nn.Parameter(torch.zeros(3)); p.grad = torch.full((3,), 4.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    out["clipped"] = [round(float(x), 4) for x in p.grad]

    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    cfg.sequence_parallel = True
    norm = WrappedTorchNorm(cfg, 8)
    out["sp_norm"] = [type(norm).__name__, all(getattr(q, "sequence_parallel", False)
                                               for q in norm.parameters()), cfg.sequence_parallel]
    print("PROBE" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          timeout=100, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE"))
    return json.loads(line[len("PROBE"):])


@pytest.mark.timeout(120)
def test_unpatched_before_and_patched_after(report: dict[str, Any]) -> None:
    assert report["before_applied"] is False
    # a CPU build: "Torch not compiled with CUDA enabled"; a CUDA build on a machine without a GPU (what pip
    # installs on Python 3.12): "No CUDA GPUs are available" / "Found no NVIDIA driver"
    assert report["before_current_device"] in NO_CUDA
    assert report["first"] is True and report["is_applied"] is True


@pytest.mark.timeout(120)
def test_megatron_jit_fuser_is_left_out_without_a_driver(report: dict[str, Any]) -> None:
    """No NVIDIA driver here: megatron-core's fusions are plain functions. On 0.16 that keeps torch's compiler stack
    out of the import (about 2 s of every rank's start-up); 0.17 and later also compile an inference router with
    ``@torch.compile`` directly, which imports it anyway."""
    import os

    if os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("an NVIDIA driver is present: megatron's default jit_fuser stays")
    jit = report["jit"]
    assert jit["fuser_disabled"] and jit["fusion_is_plain"], jit
    if report["megatron"].startswith("0.16."):
        assert not jit["dynamo_imported"] and not jit["inductor_imported"], jit


def test_lists_every_patch(report: dict[str, Any]) -> None:
    patches = report["patches"]
    for expected in ("torch.cuda.current_device", "torch.cuda.synchronize", "torch.cuda.Stream",
                     "torch.cuda.Event", "torch.cuda.current_stream", "torch.cuda.stream",
                     "megatron RNG tracker -> CPU generator",
                     *(["moe_utils.te_general_gemm = None"] if report["te_general_gemm_missing"] else []),
                     "token_dispatcher.maybe_move_tensor_to_cpu -> numpy on CPU",
                     "WrappedTorchNorm accepts sequence_parallel",
                     "mappings._gather_along_first_dim pads uneven splits (gloo)",
                     "Tensor.cuda -> identity",
                     "device='cuda' -> cpu (torch function mode)"):
        assert expected in patches
    assert any("clip_grad_by_total_norm_fp32" in p for p in patches)
    assert len(patches) == len(set(patches))


@pytest.mark.timeout(120)
def test_second_call_changes_nothing(report: dict[str, Any]) -> None:
    assert report["second"] is True
    assert report["idempotent"] is True


@pytest.mark.timeout(120)
def test_cuda_calls_run_on_cpu(report: dict[str, Any]) -> None:
    assert report["current_device"] == "cpu"
    assert report["streams_ok"] is True
    assert report["zeros_cuda"] == "cpu"
    assert report["tensor_cuda_identity"] is True


@pytest.mark.timeout(120)
def test_device_rewrite_is_thread_local(report: dict[str, Any]) -> None:
    assert report["thread"]["bare"] in NO_CUDA and report["thread"]["with_mode"] == "cpu"


@pytest.mark.timeout(120)
def test_moe_patches(report: dict[str, Any]) -> None:
    assert report["te_general_gemm"] == "None"
    assert report["splits_type"] == "numpy.ndarray"


@pytest.mark.timeout(120)
def test_rng_tracker_uses_cpu_generator(report: dict[str, Any]) -> None:
    assert report["tracker"] == {"class": "CpuRNGStatesTracker", "reproducible": True,
                                 "streams_differ": True, "seed_matters": True,
                                 "cpu_rng_untouched": True}


@pytest.mark.timeout(120)
def test_grad_clip_and_sequence_parallel_norm(report: dict[str, Any]) -> None:
    assert report["clipped"] == [1.0, 1.0, 1.0]
    # The norm is built, its params are marked for the tp all-reduce, the caller's config is intact.
    assert report["sp_norm"] == ["LayerNorm", True, True]
