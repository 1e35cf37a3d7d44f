"""Packs, provenance, diff and the catalog, in process (no subprocesses).

Packs here are real installed distributions as importlib.metadata sees them: a package plus a dist-info
with an entry point, written to a tmp folder that is put on sys.path for the test only.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lifecycle.errors import PolicyError
from lifecycle.policy import load as L
from lifecycle.policy.catalog import catalog, describe
from lifecycle.policy.diff import ABSENT, Change, diff, diff_values, parse_side
from lifecycle.policy.packs import installed_packs
from lifecycle.policy.provenance import COMMAND_LINE, DEFAULT, provenance
from lifecycle.policy.roots import config_roots, search_roots
from tests.unit.inproc import cli

MakePack = Callable[..., str]


@pytest.fixture
def make_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakePack]:
    """Install a pack into a tmp site dir on sys.path; returns its entry-point name."""
    site = tmp_path / "site d'ir, [x]"  # a folder name Hydra's override grammar must see quoted
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def make(init: str = "LIFECYCLE_SCHEMA_VERSION = 1\n", presets: dict[str, str] | None = None,
             version: str = "1.2.3") -> str:
        module = f"pk_{uuid.uuid4().hex[:8]}"
        modules.append(module)
        (site / module / "preset").mkdir(parents=True)
        (site / module / "__init__.py").write_text(init)
        for name, text in (presets or {}).items():
            (site / module / "preset" / f"{name}.yaml").write_text(text)
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}-dist\nVersion: {version}\n"
                                       "Summary: a test pack\n")
        (info / "entry_points.txt").write_text(f"[lifecycle.policy_packs]\n{module} = {module}\n")
        return module

    yield make
    for module in modules:
        sys.modules.pop(module, None)


HOUSE = "# @package _global_\ndefaults: [moe_large, _self_]\ndescription: house\ncheckpoint: {keep_last: 9}\n"


def test_usable_pack_is_searched_after_builtins_and_selectable(make_pack: MakePack) -> None:
    name = make_pack(presets={"house": HOUSE})
    pack = next(p for p in installed_packs() if p.name == name)
    assert pack.error is None and pack.schema_version == 1 and pack.summary == "a test pack"
    roots = search_roots(None)
    assert [r.origin for r in roots][:2] == ["built-in", f"pack {name} ({name}-dist 1.2.3)"]
    policy = L.load(["preset=house", "checkpoint.every_steps=3"]).policy
    assert policy.checkpoint.keep_last == 9 and policy.parallelism.ep == 4 and policy.checkpoint.every_steps == 3


@pytest.mark.parametrize(("init", "expected"), [
    ("LIFECYCLE_SCHEMA_VERSION = 7\n", "targets lifecycle policy schema version 7, but this lifecycle (0.2.0) "
                                       "reads schema version 1"),
    ("", "declares no schema version; add `LIFECYCLE_SCHEMA_VERSION = 1` to"),
    ("LIFECYCLE_SCHEMA_VERSION = '1'\n", "LIFECYCLE_SCHEMA_VERSION must be an int, got '1'"),
    ("import nonexistent_module_xyz\n", "cannot import package"),
])
def test_unusable_pack_errors_only_when_its_config_is_used(make_pack: MakePack, init: str, expected: str) -> None:
    name = make_pack(init, {"odd": "# @package _global_\ndescription: odd\n"})
    pack = next(p for p in installed_packs() if p.name == name)
    assert pack.error is not None and expected in pack.error
    assert all(r.pack is None or r.pack.name != name for r in search_roots(None))
    assert L.load([]).policy.parallelism.ep == 2  # everything else still works
    with pytest.raises(PolicyError, match=rf"pack {name} \({name}-dist 1.2.3\): unusable pack \(it ships "
                                          r"preset/odd.yaml"):
        L.load(["preset=odd"])


def test_diff_values_by_key_path() -> None:
    a = {"x": {"y": 1, "z": [1, 2]}, "l": [{"g": "world"}], "only_a": 1}
    b = {"x": {"y": 2, "z": [1, 2, 3]}, "l": [{"g": "world"}, {"g": "edp"}], "only_b": True}
    assert diff_values(a, b) == [
        Change("x.y", 1, 2), Change("x.z", [1, 2], [1, 2, 3]), Change("l.1", ABSENT, {"g": "edp"}),
        Change("only_a", 1, ABSENT), Change("only_b", ABSENT, True)]
    assert str(Change("x.z", [1], ABSENT)) == "x.z: [1] -> (absent)" and diff_values(a, a) == []


def test_parse_side() -> None:
    assert parse_side("", "config") == ("config", [])
    assert parse_side("house parallelism.ep=8", "config") == ("house", ["parallelism.ep=8"])
    assert parse_side("~barriers 'run.name=a b'", "config") == ("config", ["~barriers", "run.name=a b"])


def test_diff_presets() -> None:
    d = diff("preset=moe", "preset=moe_large checkpoint.async=false", ["run.id=x"])
    paths = {c.path: (c.a, c.b) for c in d.changes}
    assert paths["parallelism.ep"] == (2, 4) and paths["train.options.num_experts"] == (4, 8)
    assert "checkpoint.async" not in paths and "run.id" not in paths and d.a.overrides == ("run.id=x", "preset=moe")
    assert diff("", "preset=moe").changes == []


def test_provenance_of_builtins_overrides_and_deletes() -> None:
    loaded = L.load(["preset=moe_large", "checkpoint.keep_last=7", "~barriers", "train.options={hidden: 32}"])
    src = provenance(loaded)
    assert (src["parallelism.tp"].source, src["parallelism.tp"].file) == ("built-in", "preset/moe_large.yaml")
    assert src["run.dir"].file == "config.yaml" and src["checkpoint.dir"].file == "config.yaml"
    assert src["checkpoint.keep_last"].source == COMMAND_LINE
    assert src["train.options.hidden"].source == COMMAND_LINE
    assert src["train.options.num_experts"].file == "preset/moe_large.yaml"  # a mapping override merges
    assert src["barriers.after_init"].source == DEFAULT and src["train.options.lr"].source == DEFAULT
    assert set(src) >= {"faults", "watchdog.deadlines.init"}


def test_provenance_user_dir_and_group_choices(tmp_path: Path) -> None:
    (tmp_path / "house.yaml").write_text("defaults: [_self_, preset: dense, checkpoint: async]\n"
                                         "run: {name: house}\ntrain: {steps: 3}\n")
    src = provenance(L.load(["+warmup=minimal"], config_dir=tmp_path, config_name="house"))
    assert (src["run.name"].source, src["run.name"].file) == ("user dir", "house.yaml")
    assert src["train.steps"].file == "preset/dense.yaml"  # _self_ first: the preset wins
    assert src["checkpoint.async"].file == "checkpoint/async.yaml"
    assert src["warmup.ops"].file == "warmup/minimal.yaml"


def test_catalog_and_descriptions(tmp_path: Path) -> None:
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "moe.yaml").write_text("# @package _global_\n# Mine. More text.\n# more\nrun: {}\n")
    (tmp_path / "house.yaml").write_text("description: 'my house'\n")
    entries = catalog(config_roots(tmp_path))
    moe = [(e.origin, e.shadowed_by, e.description) for e in entries if (e.group, e.name) == ("preset", "moe")]
    assert moe[0] == ("user dir", None, "Mine.") and moe[1][:2] == ("built-in", "user dir")
    configs = [(e.name, e.description) for e in entries if not e.group]
    assert configs == [("house", "my house")]  # the built-in config.yaml is not the first folder here
    assert describe(tmp_path / "missing.yaml").startswith("(unreadable")


@pytest.fixture
def handler_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Install a distribution whose ``lifecycle.handlers`` entry point is ``<module>:SPECS``; the registry loads the
    entry points again for this test only. Returns the module (= entry point) name."""
    from lifecycle.policy import registry

    site = tmp_path / "handler_site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    modules: list[str] = []

    def make(init: str, files: dict[str, str] | None = None) -> str:
        module = f"hk_{uuid.uuid4().hex[:8]}"
        modules.append(module)
        (site / module).mkdir()
        (site / module / "__init__.py").write_text(init)
        for name, text in (files or {}).items():
            (site / module / name).write_text(text)
        info = site / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}-dist\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[lifecycle.handlers]\n{module} = {module}:SPECS\n")
        return module

    yield make
    for module in modules:
        for loaded in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
            sys.modules.pop(loaded, None)


HANG = "import time\ntime.sleep(30)\n"
SYNTHETIC = ["~train.options", "moe.zero_token.action=off", "parallelism.ep=1"]


@pytest.mark.timeout(20)
def test_a_pack_whose_import_hangs_is_skipped_with_a_warning(make_pack: MakePack, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LIFECYCLE_IMPORT_TIMEOUT_S", "0.3")
    name = make_pack(HANG)
    start = time.monotonic()
    code, out, err = cli(capsys, "validate")
    assert code == 0 and out.startswith("ok: ") and time.monotonic() - start < 5
    assert f"pack {name} ({name}-dist 1.2.3): importing package '{name}' did not finish within 0.3s; the pack is " \
           "skipped (raise LIFECYCLE_IMPORT_TIMEOUT_S if it is only slow)" in err
    code, out, err = cli(capsys, "policies")  # the same process: its package is not imported again
    assert code == 2 and f"UNUSABLE: importing package '{name}' did not finish within 0.3s" in out
    assert time.monotonic() - start < 5


def test_what_a_pack_prints_at_import_stays_off_stdout(make_pack: MakePack,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["explain", "--json"], ["policies", "--json"], ["diff", "--json", "", "run.seed=1"]):
        make_pack('print("hello from the pack")\nLIFECYCLE_SCHEMA_VERSION = 1\n')  # a new one: each imports once
        code, out, err = cli(capsys, *argv)
        assert code in (0, 1) and isinstance(json.loads(out), dict) and "hello from the pack" in err, argv


@pytest.mark.timeout(20)
def test_a_handler_entry_point_whose_import_hangs_is_left_out(handler_pack: Callable[..., str],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from lifecycle.policy import registry

    monkeypatch.setenv("LIFECYCLE_IMPORT_TIMEOUT_S", "0.3")
    name = handler_pack(HANG)
    start = time.monotonic()
    assert registry.kinds("train") == ["megatron_gpt", "synthetic"] and time.monotonic() - start < 5
    assert f"handler entry point {name} ({name}-dist) is left out: importing '{name}' did not finish within 0.3s" \
        in caplog.text


STEP = "raise RuntimeError('a factory check must not run this module')\nclass Bare:\n    def step(self): ...\n"


@pytest.mark.parametrize(("factory", "why"), [
    ("hk_nowhere.step:Step", "module 'hk_nowhere.step' is not installed (No module named 'hk_nowhere')"),
    ("builtins:dict", "builtins.dict is a class without setup(), step(), begin_save(), load(), close(): not a step "
                      "handler"),
    ("{module}.step:Nope", "module '{module}.step' ({path}) defines no 'Nope'"),
    ("{module}.step:Bare", "{module}.step.Bare is a class without setup(), begin_save(), load(), close()"),
], ids=["no_module", "builtins_dict", "no_attribute", "bare_class"])
def test_a_kind_whose_factory_cannot_build_a_handler_is_refused_before_any_rank_starts(
        handler_pack: Callable[..., str], factory: str, why: str) -> None:
    from lifecycle.launch.runner import run

    module = handler_pack("from lifecycle.handlers import HandlerSpec\n"
                          "from lifecycle.policy.options import SyntheticOptions\n"
                          f"SPECS = [HandlerSpec('bad_kind', 'train', SyntheticOptions, {factory!r}.format("
                          "module=__name__), groups='torch')]\n", {"step.py": STEP})
    path = Path(importlib.util.find_spec(module).submodule_search_locations[0]) / "step.py"  # type: ignore[union-attr]
    with pytest.raises(PolicyError) as exc:
        L.load(["train.kind=bad_kind", *SYNTHETIC])
    issue = exc.value.issues[0]
    assert (issue.path, issue.value) == ("train.kind", "bad_kind")
    assert issue.message.startswith(f"train handler kind 'bad_kind' (entry point '{module} = {module}:SPECS' of "
                                    f"package {module}-dist) cannot build a handler: "
                                    f"{why.format(module=module, path=path)}"), issue.message
    assert f"{module}.step" not in sys.modules  # read, never run
    with pytest.raises(PolicyError, match="train handler kind 'bad_kind'"):  # `run` refuses before any rank starts
        run(["train.kind=bad_kind", *SYNTHETIC], nproc=2)
