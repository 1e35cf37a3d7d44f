"""``distributed.nccl_env`` and ``distributed.connect``: an allow-list with types, one environment for every rank."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.errors import PolicyError
from lifecycle.policy import nccl
from lifecycle.policy.load import validate


def _dist(**kw: object) -> dict[str, object]:
    return {"distributed": kw}


def test_connect_sets_runtime_connect_and_the_settings_become_strings() -> None:
    p = validate(_dist(nccl_env={"NCCL_BUFFSIZE": 2 << 20, "NCCL_NVLS_ENABLE": False, "NCCL_PROTO": "^LL128"}))
    assert p.distributed.connect == "eager"
    assert p.distributed.effective_nccl_env() == {"NCCL_BUFFSIZE": "2097152", "NCCL_NVLS_ENABLE": "0",
                                                  "NCCL_PROTO": "^LL128", "NCCL_RUNTIME_CONNECT": "0"}
    assert validate(_dist(connect="lazy")).distributed.effective_nccl_env() == {"NCCL_RUNTIME_CONNECT": "1"}
    same = validate(_dist(connect="lazy", nccl_env={"NCCL_RUNTIME_CONNECT": 1}))
    assert same.distributed.effective_nccl_env() == {"NCCL_RUNTIME_CONNECT": "1"}


@pytest.mark.parametrize(("env", "connect", "needle"), [
    ({"NCCL_BUFSIZE": 4096}, "eager", "distributed.nccl_env.NCCL_BUFSIZE: not a setting lifecycle manages; did you "
                                      "mean NCCL_BUFFSIZE?"),
    ({"NCCL_MAX_NCHANNELS": True}, "eager", "NCCL_MAX_NCHANNELS: must be an integer"),
    ({"NCCL_MAX_NCHANNELS": 65}, "eager", "NCCL_MAX_NCHANNELS: must be in [1, 64]"),
    ({"NCCL_ALGO": "Ring,Fast"}, "eager", "NCCL_ALGO: unknown Fast; choose among Ring, Tree"),
    ({"NCCL_DEBUG": "LOUD"}, "eager", "NCCL_DEBUG: must be one of VERSION, WARN, INFO, TRACE"),
    ({"NCCL_NVLS_ENABLE": 2}, "eager", "NCCL_NVLS_ENABLE: must be true/false (or 1/0)"),
    ({"NCCL_SOCKET_IFNAME": "eth0\nX=1"}, "eager", "NCCL_SOCKET_IFNAME: must be a one-line string"),
    ({"NCCL_RUNTIME_CONNECT": True}, "eager", "NCCL_RUNTIME_CONNECT: contradicts distributed.connect=eager"),
    ({"NCCL_RUNTIME_CONNECT": 0}, "lazy", "NCCL_RUNTIME_CONNECT: contradicts distributed.connect=lazy"),
])
def test_a_bad_setting_is_named_with_its_key(env: dict[str, object], connect: str, needle: str) -> None:
    with pytest.raises(PolicyError) as info:
        validate(_dist(nccl_env=env, connect=connect))
    assert needle in str(info.value), str(info.value)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(sorted(nccl.KNOBS)), st.one_of(st.booleans(), st.integers(-5, 1 << 33),
                                                                       st.sampled_from(["LL", "Ring,Tree", "INFO",
                                                                                        "eth0", "", "PIX", "^NVLS"])),
                       max_size=6))
def test_every_mapping_is_accepted_exactly_when_each_value_fits_its_knob(env: dict[str, object]) -> None:
    issues = nccl.check(env)
    assert {i.path.rsplit(".", 1)[1] for i in issues} == {k for k, v in env.items() if nccl._bad(nccl.KNOBS[k], v)}
    if not issues:
        out = nccl.effective(env, "lazy" if env.get("NCCL_RUNTIME_CONNECT") in (1, True) else "eager")
        assert all(isinstance(v, str) and "\n" not in v for v in out.values()) and "NCCL_RUNTIME_CONNECT" in out
