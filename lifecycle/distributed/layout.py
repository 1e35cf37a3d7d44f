"""Which ranks form which process group: a pure-Python port of Megatron-Core's group layout.

Megatron-Core (0.16.1, ``parallel_state.initialize_model_parallel``) derives every group from two
``RankGenerator`` grids: the decoder grid ``tp-cp-ep-dp-pp`` (ep = 1) and the expert grid
``etp-ep-edp-pp`` (cp = 1), plus a few groups built from those (embedding = first and last pipeline
stage, position embedding = first stage, distributed-optimizer instances and the intra/inter partial
expert-data-parallel groups). This module reproduces that arithmetic without torch or megatron, so
``lifecycle explain`` can show the groups of any rank of a 16k-rank job in milliseconds.

Ranks of a group are listed in communicator order: ascending, as ``torch.distributed.new_group``
sorts them (so ``ranks_of`` equals ``get_process_group_ranks`` of the real group).
"""

from __future__ import annotations

import math

from lifecycle.distributed.names import GROUP_NAMES, closest
from lifecycle.errors import UsageError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMS = ("tp", "pp", "dp", "ep", "cp")

# name -> dimensions (a RankGenerator token) in the decoder / expert grid. Gloo twins share ranks.
_DECODER = {
    "dp": "dp", "dp_gloo": "dp", "dp_cp": "dp-cp", "dp_cp_gloo": "dp-cp", "tp": "tp", "pp": "pp",
    "cp": "cp", "mp": "tp-pp", "tp_cp": "tp-cp", "tp_dp": "tp-dp", "tp_dp_cp": "tp-dp-cp",
}
_EXPERT = {"ep": "ep", "etp": "tp", "edp": "dp", "edp_gloo": "dp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp"}


class _Grid:
    """One Megatron ``RankGenerator``: rank = sum(coord[d] * stride[d]) over the ordered dims."""

    def __init__(self, sizes: dict[str, int], order: str) -> None:
        dims = order.split("-")
        dims += [d for d in _DIMS if d not in dims]  # Megatron appends the size-1 dims it was not told
        self.dims = dims
        self.shape = [sizes[d] for d in dims]
        self.stride = [math.prod(self.shape[:i]) for i in range(len(dims))]
        self.world = math.prod(self.shape)
        self._offsets: dict[str, list[int]] = {}

    def _masked(self, token: str) -> tuple[list[int], list[int]]:
        wanted = set(token.split("-"))
        masked = [i for i, d in enumerate(self.dims) if d in wanted]
        return masked, [i for i in range(len(self.dims)) if i not in masked]

    def offsets(self, token: str) -> list[int]:
        """Offsets of the members from the group's base rank, in Megatron's (ascending) order."""
        if token not in self._offsets:
            out = [0]
            for i in self._masked(token)[0]:  # first masked dim varies fastest, as in Megatron
                out = [o + k * self.stride[i] for k in range(self.shape[i]) for o in out]
            self._offsets[token] = sorted(out)
        return self._offsets[token]

    def base(self, rank: int, token: str) -> int:
        unmasked = self._masked(token)[1]
        return sum((rank // self.stride[i]) % self.shape[i] * self.stride[i] for i in unmasked)

    def index(self, rank: int, token: str) -> int:
        """Position of the rank's group in Megatron's list of groups for ``token``."""
        idx, mult = 0, 1
        for i in self._masked(token)[1]:
            idx += (rank // self.stride[i]) % self.shape[i] * mult
            mult *= self.shape[i]
        return idx

    def group_of(self, rank: int, token: str) -> list[int]:
        base = self.base(rank, token)
        return [base + o for o in self.offsets(token)]

    def groups(self, token: str) -> list[list[int]]:
        unmasked = self._masked(token)[1]
        bases = [0]
        for i in unmasked:  # first unmasked dim varies fastest: Megatron's group order
            bases = [b + k * self.stride[i] for k in range(self.shape[i]) for b in bases]
        offs = self.offsets(token)
        return [[b + o for o in offs] for b in bases]


def _check_order(order: str, sizes: dict[str, int], which: str) -> None:
    dims = order.split("-")
    unknown = [d for d in dims if d not in _DIMS]
    if unknown or len(set(dims)) != len(dims):
        raise UsageError(f"order {order!r} must be distinct dims from {'-'.join(_DIMS)}")
    missing = [d for d in _DIMS if d not in dims and sizes[d] != 1]
    if missing:
        raise UsageError(f"order {order!r} lacks {missing} whose {which} size is > 1")


def _divisible(a: int, b: int, what_a: str, what_b: str, detail: str = "") -> None:
    if a % b:
        raise UsageError(f"{what_a} {a} is not divisible by {what_b} = {b}{detail}")


class Layout:
    """Every Megatron process group of one job, computed on demand.

    ``dp``/``edp`` are the data-parallel sizes of the dense and expert parts; ``intra_edp`` the
    expert-dp size inside one distributed-optimizer instance.
    """

    def __init__(self, world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int,
                 dist_opt_instances: int, order: str) -> None:
        self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp = world_size, tp, pp, cp, ep, etp
        self.dist_opt_instances, self.order = dist_opt_instances, order
        self.dp = world_size // (tp * pp * cp)
        self.edp = world_size // (etp * ep * pp)
        self.intra_edp = self.edp // dist_opt_instances
        self._dec = _Grid({"tp": tp, "pp": pp, "dp": self.dp, "ep": 1, "cp": cp}, order)
        self._exp = _Grid({"tp": etp, "pp": pp, "dp": self.edp, "ep": ep, "cp": 1}, order)

    def __repr__(self) -> str:
        return (f"Layout(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, "
                f"ep={self.ep}, etp={self.etp}, dp={self.dp}, edp={self.edp}, "
                f"dist_opt_instances={self.dist_opt_instances}, order={self.order!r})")

    @property
    def sizes(self) -> dict[str, int]:
        """The parallel sizes by name (tp, pp, cp, ep, etp, dp, edp, dist_opt_instances)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp,
                "dp": self.dp, "edp": self.edp, "dist_opt_instances": self.dist_opt_instances}

    def exists(self, name: str) -> bool:
        """Whether Megatron creates groups of this kind at all in this layout."""
        _check_name(name)
        return name != "inter_dist_opt" or self.dist_opt_instances > 1

    def groups(self, name: str) -> list[list[int]]:
        """All groups of kind ``name`` in Megatron's creation order; [] if the kind does not exist."""
        _check_name(name)
        if not self.exists(name):
            return []
        if name == "world":
            return [list(range(self.world_size))]
        if name in _DECODER:
            return self._dec.groups(_DECODER[name])
        if name in _EXPERT:
            return self._exp.groups(_EXPERT[name])
        if name in ("embd", "pos_embd"):
            return [self._embedding(p, name) for p in self._dec.groups("pp")]
        if name == "intra_dist_opt":
            n = self.edp // self.intra_edp
            return [self._intra_dist_opt(k) for k in range(n)]
        return [g for e in self._exp.groups("dp") for g in self._split_edp(e, name)]

    def ranks_of(self, name: str, rank: int) -> list[int] | None:
        """The ranks of the ``name`` group that contains ``rank``, or None if it is in none."""
        _check_name(name)
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside world size {self.world_size}")
        if not self.exists(name):
            return None
        if name == "world":
            return list(range(self.world_size))
        if name in _DECODER:
            return self._dec.group_of(rank, _DECODER[name])
        if name in _EXPERT:
            return self._exp.group_of(rank, _EXPERT[name])
        if name in ("embd", "pos_embd"):
            group = self._embedding(self._dec.group_of(rank, "pp"), name)
            return group if rank in group else None
        if name == "intra_dist_opt":
            return self._intra_dist_opt(self._exp.index(rank, "tp-ep-pp") // self.intra_edp)
        return next(g for g in self._split_edp(self._exp.group_of(rank, "dp"), name) if rank in g)

    def distinct_groups_of(self, rank: int) -> list[tuple[list[str], list[int]]]:
        """Each distinct rank set containing ``rank``, with every name that maps to it.

        Megatron hands the same ranks out under several names (tp and tp_cp when cp = 1, dp and its
        gloo twin, ...); the order is that of the first name in ``names.GROUP_NAMES``.
        """
        seen: dict[tuple[int, ...], list[str]] = {}
        for name in GROUP_NAMES:
            ranks = self.ranks_of(name, rank)
            if ranks is not None:
                seen.setdefault(tuple(ranks), []).append(name)
        return [(names, list(ranks)) for ranks, names in seen.items()]

    def _embedding(self, pp_ranks: list[int], name: str) -> list[int]:
        # Megatron's default_embedding_ranks / default_position_embedding_ranks.
        if name == "pos_embd" or len(pp_ranks) == 1:
            return [pp_ranks[0]]
        return [pp_ranks[0], pp_ranks[-1]]

    def _intra_dist_opt(self, instance: int) -> list[int]:
        # Megatron concatenates `intra_edp` consecutive tp-ep-pp groups into one instance.
        first = instance * self.intra_edp
        out: list[int] = []
        for k in range(first, first + self.intra_edp):
            out += self._exp_mp_group(k)
        return sorted(out)

    def _exp_mp_group(self, index: int) -> list[int]:
        # The index-th tp-ep-pp group without listing them all: its only unmasked dims are dp (and
        # cp, of size 1 in the expert grid), so the index is the dp coordinate.
        dp_dim = self._exp.dims.index("dp")
        return self._exp.group_of(index * self._exp.stride[dp_dim], "tp-ep-pp")

    def _split_edp(self, edp_ranks: list[int], name: str) -> list[list[int]]:
        # Megatron's create_hierarchical_groups(edp_ranks, [intra_edp, instances]): level 0 takes
        # consecutive chunks, level 1 (inter_dist_opt) takes one rank of each chunk.
        n, size = self.dist_opt_instances, self.intra_edp
        if name == "intra_edp":
            return [edp_ranks[k * size:(k + 1) * size] for k in range(n)]
        return [sorted(edp_ranks[j::size]) for j in range(size)]


def _check_name(name: str) -> None:
    if name not in GROUP_NAMES:
        hint = closest(name)
        raise UsageError(f"unknown group name {name!r}"
                         + (f"; did you mean {hint!r}?" if hint else f". Available names: {', '.join(GROUP_NAMES)}"))


def build_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None, dist_opt_instances: int = 1,
                 order: str = DEFAULT_ORDER) -> Layout:
    """Check the sizes as Megatron's ``initialize_model_parallel`` does and return the layout.

    Raises UsageError naming the sizes and the broken rule when Megatron would refuse them.
    """
    etp = tp if etp is None else etp
    given = {"world size": world_size, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp,
             "dist_opt_instances": dist_opt_instances}
    bad = {k: v for k, v in given.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise UsageError(f"parallel sizes must be integers >= 1, got {bad}")
    _divisible(world_size, tp * pp * cp, "world size", "tp*pp*cp", f" (tp={tp}, pp={pp}, cp={cp})")
    _divisible(world_size, etp * ep * pp, "world size", "etp*ep*pp", f" (etp={etp}, ep={ep}, pp={pp})")
    dp, edp = world_size // (tp * pp * cp), world_size // (etp * ep * pp)
    _divisible(dp * cp, dist_opt_instances, "dp*cp", "dist_opt_instances")
    _divisible(edp, dist_opt_instances, "expert dp (world/(etp*ep*pp))", "dist_opt_instances")
    _check_order(order, {"tp": tp, "pp": pp, "dp": dp, "ep": 1, "cp": cp}, "dense")
    _check_order(order, {"tp": etp, "pp": pp, "dp": edp, "ep": ep, "cp": 1}, "expert")
    layout = Layout(world_size, tp, pp, cp, ep, etp, dist_opt_instances, order)
    if pp > 1 and not order.endswith("pp"):
        _check_pp_agrees(layout)
    return layout


def _check_pp_agrees(layout: Layout) -> None:
    # Megatron asserts both grids give the same pipeline groups; with pp last they always do.
    if layout.dp != layout.edp:
        raise UsageError(f"order {layout.order!r} does not end with pp, so dp ({layout.dp}) must equal "
                         f"expert dp ({layout.edp}); put pp last or change etp/ep")
    if layout._dec.groups("pp") != layout._exp.groups("pp"):
        raise UsageError(f"order {layout.order!r} gives different pipeline groups for the dense and "
                         f"expert parts; put pp last")

