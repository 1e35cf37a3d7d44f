"""Hostile input stopped before it costs anything: the YAML guard, the override checks, the interpolation
bound and the error clipping (no processes; the CLI end to end is in tests/cli/test_hostile.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lifecycle.errors import PolicyError, PolicyIssue
from lifecycle.policy import yamlguard
from lifecycle.policy.errors import Clipped, clip_error, clip_value
from lifecycle.policy.interpolation import MAX_RESOLUTIONS, check_interpolations
from lifecycle.policy.load import compose, load, validate
from lifecycle.policy.overrides import nesting, quote_unicode

BAD = Path(__file__).resolve().parents[2] / "cli" / "bad_policies"


def _issue(exc: pytest.ExceptionInfo[PolicyError]) -> str:
    return str(exc.value.issues[0])


@pytest.mark.timeout(10)
def test_alias_bomb_is_refused_after_at_most_the_limit_in_work() -> None:
    start = time.perf_counter()
    with pytest.raises(PolicyError) as exc:
        yamlguard.check_file(BAD / "alias_bomb.yaml")
    assert time.perf_counter() - start < 0.5
    assert "alias_bomb.yaml:6:20: the policy files expand to more than 5000 values" in _issue(exc)


def test_a_budget_is_shared_by_the_files_of_one_compose() -> None:
    budget = yamlguard.Budget(10)
    yamlguard.check_yaml("a: [1, 2, 3]", "one.yaml", budget)  # 6 values: a mapping, a key, a list of 3
    with pytest.raises(PolicyError, match=r"two.yaml:1:\d+: the policy files expand to more than 10 values"):
        yamlguard.check_yaml("b: [1, 2]", "two.yaml", budget)


def test_anchors_count_in_full_each_time_they_are_used() -> None:
    text = "a: &a [" + ", ".join(["x"] * 100) + "]\n" + "\n".join(f"b{i}: *a" for i in range(60))
    with pytest.raises(PolicyError, match="more than 5000 values"):
        yamlguard.check_yaml(text, "f.yaml")
    yamlguard.check_yaml(text.rsplit("\n", 20)[0], "f.yaml")  # 40 uses: 4,000 values, under the limit


def test_depth_syntax_and_integer_limits_name_the_place() -> None:
    with pytest.raises(PolicyError, match=r"f.yaml:1:35: nested deeper than 32 levels"):
        yamlguard.check_yaml("x: " + "[" * 32 + "]" * 32, "f.yaml")  # the mapping is the first level
    yamlguard.check_yaml("x: " + "[" * 31 + "]" * 31, "f.yaml")
    with pytest.raises(PolicyError, match=r"f.yaml:3:1: not valid YAML: .*flow mapping"):
        yamlguard.check_yaml("a: 1\nb: {c: 2\n", "f.yaml")
    with pytest.raises(PolicyError, match="f.yaml:1:4: an integer of 4301 digits"):
        yamlguard.check_yaml("x: " + "1" * 4301, "f.yaml")
    yamlguard.check_yaml("x: '" + "1" * 5000 + "'", "f.yaml")  # a quoted string is a string


def test_size_limit_and_its_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("description: " + "x" * 2000 + "\n")
    monkeypatch.setenv(yamlguard.MAX_BYTES_ENV, "1000")
    with pytest.raises(PolicyError) as exc:
        yamlguard.check_file(f)
    assert f"larger than the limit of 1000 bytes; shrink it, or raise the limit with {yamlguard.MAX_BYTES_ENV}" \
        in _issue(exc) and "(got 2014)" in _issue(exc)
    monkeypatch.setenv(yamlguard.MAX_BYTES_ENV, "4096")
    yamlguard.check_file(f)
    monkeypatch.setenv(yamlguard.MAX_BYTES_ENV, "lots")
    with pytest.raises(PolicyError, match=f"{yamlguard.MAX_BYTES_ENV}: must be a positive number of bytes"):
        yamlguard.check_file(f)


def test_utf8_errors_name_the_byte_offset_and_odd_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="not_utf8.yaml:3: not UTF-8: byte 0xE9 at byte offset 79"):
        yamlguard.check_file(BAD / "not_utf8.yaml")
    with pytest.raises(PolicyError, match="is not a regular file"):
        yamlguard.check_file(tmp_path)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(PolicyError, match="is not a regular file"):  # and does not wait for a writer
        yamlguard.check_file(fifo)
    with pytest.raises(PolicyError, match="cannot open the policy file"):
        yamlguard.check_file(tmp_path / "missing.yaml")


def test_the_hydra_patch_is_in_place_only_during_a_compose() -> None:
    from hydra._internal.core_plugins.file_config_source import FileConfigSource

    before = FileConfigSource.load_config
    with pytest.raises(PolicyError, match="alias_bomb.yaml"):
        load(config_dir=BAD, config_name="alias_bomb")
    assert FileConfigSource.load_config is before
    assert load(["preset=moe_large"]).policy.description.startswith("house MoE")  # built-ins pass the guard


def test_every_file_hydra_reads_is_checked(tmp_path: Path) -> None:
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "mine.yaml").write_bytes(b"# @package _global_\ndescription: caf\xe9\n")
    (tmp_path / "house.yaml").write_text("defaults: [preset: mine, _self_]\n")
    with pytest.raises(PolicyError) as exc:
        load(config_dir=tmp_path, config_name="house")
    assert "preset/mine.yaml:2: not UTF-8" in _issue(exc)


@pytest.mark.parametrize(("overrides", "match"), [
    (["checkpoint=5"], "checkpoint: a config group takes the name of one of its options: async, off"),
    (["+x=" + "{a: " * 33 + "1" + "}" * 33], "nests 33 brackets deep"),
    (["x=1\x00"], "contains a NUL character"),
    (["hydra/launcher=basic"], "policies configure lifecycle, not Hydra"),
    (["preset@hydra=moe"], "policies configure lifecycle, not Hydra"),
    (["a" * 300 + "=1"], "a part longer than 255 characters"),
    (["a=[1,"], "bad override syntax"),
])
def test_overrides_are_checked_one_by_one(overrides: list[str], match: str) -> None:
    with pytest.raises(PolicyError) as exc:
        compose(overrides)
    assert match in _issue(exc)


@pytest.mark.parametrize("name", ["训练", "café", "Ωmega-2", "a b"])
def test_run_name_takes_any_script(name: str) -> None:
    policy = load([f"run.name={name}"]).policy
    assert policy.run.name == name and policy.run.dir == f"runs/{name}-local"


@pytest.mark.parametrize(("name", "why"), [
    ("a/b", "contains '/'"), ("..", "is '..'"), (".", "is '.'"), ("a\x00b", "contains a NUL character"),
    ("a\nb", "contains a control character"), ("é" * 101, "is 202 bytes long in UTF-8 (at most 200)"),
])
def test_a_run_name_that_cannot_be_a_folder_name_is_named(name: str, why: str) -> None:
    with pytest.raises(PolicyError) as exc:
        validate({"run": {"name": name}})
    assert _issue(exc).startswith(f"run.name: cannot be part of a folder name: it {why} (the run directory is "
                                  "runs/<run.name>-<run.id>)")


def test_only_plain_non_ascii_values_are_quoted_for_hydra() -> None:
    assert quote_unicode("run.name=训练") == "run.name='训练'" and quote_unicode("+x=café ") == "+x='café'"
    for text in ("run.name=plain", "x=[é]", "x='é'", "x=${oc.env:É}", "~x", "x=a\\é"):
        assert quote_unicode(text) == text


def test_bracket_nesting_ignores_quotes() -> None:
    assert nesting("x=[[1], {a: [2]}]") == 3
    assert nesting("x='[[[[' ") == 0 and nesting(r"x='it\'s [[' ") == 0 and nesting('x="]]" [[1]]') == 2


def _doubling(levels: int) -> dict[str, object]:
    data: dict[str, object] = {"a0": "x" * 8}
    for i in range(1, levels + 1):
        data[f"a{i}"] = f"${{a{i - 1}}}${{.a{i - 1}}}"
    return data


def test_interpolation_bombs_are_refused_by_key() -> None:
    check_interpolations(_doubling(8))  # 2+6+...+510 = 1004 resolutions: under the limit
    with pytest.raises(PolicyError, match=rf"a10: resolving the interpolations here needs 2046 resolutions "
                                          rf"\(the limit is {MAX_RESOLUTIONS}\)"):
        check_interpolations(_doubling(12))
    nested = {"s": {"a": "y" * 20_000, "b": {"c": "${..a}${..a}${..a}"}}, "t": ["${s.b}"] * 100}
    with pytest.raises(PolicyError, match=r"t: resolving the interpolations here gives \d+ characters"):
        check_interpolations(nested)
    check_interpolations({"a": "${a}", "b": "${missing.key}", "c": "${oc.env:HOME,${b}}"})  # OmegaConf's errors


def test_values_and_messages_are_clipped() -> None:
    long = "v" * 500_000
    assert clip_value(3) == 3 and clip_value(long[:100]) == long[:100]
    shown = repr(clip_value(long))
    assert len(shown) < 260 and shown.endswith("(500002 characters in all)")
    assert isinstance(clip_value(10**5000), Clipped)  # repr() of such an int raises
    err = clip_error(PolicyError([PolicyIssue(f"k{i}", "m" * 10_000, long) for i in range(80)], source=long))
    text = str(err)
    assert len(text) < 60_000 and "... and 30 more errors" in text and text.count("\n") == 51


def test_a_huge_value_is_cut_in_the_error() -> None:
    with pytest.raises(PolicyError) as exc:
        load(["checkpoint.keep_last=" + "x" * 4000])
    assert len(str(exc.value)) < 600 and "(4002 characters in all)" in str(exc.value)
