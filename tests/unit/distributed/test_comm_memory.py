"""The communicator bill before launch: a documented formula, monotone in what grows it, duplicates named."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.distributed.comm_memory import MIB, Settings, communicator_bytes, estimate, rank_bill
from lifecycle.distributed.layout import build_layout
from lifecycle.policy.groupnames import GROUP_NAMES


def test_a_two_rank_communicator_at_the_defaults_matches_the_published_order_of_magnitude() -> None:
    # NCCL issue #964: 544 MB for a 2-rank communicator on A100 at NCCL's defaults.
    got = communicator_bytes(2, intra_node=True, settings=Settings())
    assert 544e6 / 10 < got < 544e6 * 10 and got == 294 * MIB
    assert communicator_bytes(1, intra_node=True, settings=Settings()) == 0  # no peer, no buffers


@settings(max_examples=100, deadline=None, derandomize=True)
@given(n=st.integers(2, 4096), buff=st.integers(1 << 12, 1 << 26), channels=st.integers(1, 32),
       intra=st.booleans(), eager=st.booleans())
def test_the_estimate_grows_with_buffer_size_channels_and_connecting_eagerly(n: int, buff: int, channels: int,
                                                                          intra: bool, eager: bool) -> None:
    def cost(**kw: object) -> int:
        base = {"buffsize": buff, "max_channels": channels, "eager": eager}
        return communicator_bytes(n, intra_node=intra, settings=Settings(**{**base, **kw}))  # type: ignore[arg-type]

    assert cost(buffsize=buff * 2) > cost()
    assert cost(max_channels=channels + 1) > cost()
    assert cost(eager=True) >= cost(eager=False)
    assert cost(protocols=("Simple",)) < cost()


def test_identical_rank_sets_are_named_with_what_the_extra_communicators_cost() -> None:
    layout = build_layout(16, ep=4)
    groups = {n: g for n in GROUP_NAMES if (g := layout.group_of(n, 0)) is not None}
    bill = rank_bill(layout, 0, 8, Settings(), None).as_dict()
    same = {tuple(d["groups"]) for d in bill["identical_rank_sets"]}
    assert ("world", "dp", "dp_cp", "tp_dp", "tp_dp_cp", "intra_dist_opt") in same
    # One optimizer instance: intra_dp_cp and intra_edp are megatron's dp_cp and edp objects, no communicator
    assert not {"intra_dp_cp", "intra_edp"} & {c["group"] for c in bill["communicators"]}
    assert estimate(groups, 0, 8, Settings()).total > bill["total_bytes"]
    assert all(d["bytes"] > 0 for d in bill["identical_rank_sets"])
    assert not any(c["group"].endswith("_gloo") for c in bill["communicators"])  # gloo twins: no device memory
    fewer = estimate(groups, 0, 8, Settings(), warmed=["ep", "edp"]).as_dict()
    assert [c["group"] for c in fewer["communicators"]] == ["world", "ep", "edp"]  # the default group always
    assert fewer["total_bytes"] < bill["total_bytes"]
    # More groups, more memory: the same layout with two optimizer instances adds the instance groups.
    two = build_layout(16, ep=4, dist_opt_instances=2)
    more = {n: g for n in GROUP_NAMES if (g := two.group_of(n, 0)) is not None}
    assert len(estimate(more, 0, 8, Settings()).communicators) > len(bill["communicators"])


def test_settings_follow_the_policy_environment() -> None:
    s = Settings.of({"NCCL_BUFFSIZE": "2097152", "NCCL_MAX_NCHANNELS": "4", "NCCL_PROTO": "^LL128",
                     "NCCL_RUNTIME_CONNECT": "1", "NCCL_NVLS_ENABLE": "1"})
    assert (s.buffsize, s.max_channels, s.protocols, s.eager, s.nvls) == (2097152, 4, ("LL", "Simple"), False, True)
    assert Settings.of({"NCCL_PROTO": "Simple"}).protocols == ("Simple",)
