"""Which ranks form which process group: a pure-Python port of Megatron-Core's group layout.

Megatron-Core (0.16.1, ``parallel_state.initialize_model_parallel``) derives every group from two
``RankGenerator`` grids: the decoder grid ``tp-cp-ep-dp-pp`` (ep = 1) and the expert grid
``etp-ep-edp-pp`` (cp = 1), plus a few groups built from those (embedding = first and last pipeline
stage, position embedding = first stage, distributed-optimizer instances and the intra/inter partial
expert-data-parallel groups). This module reproduces that arithmetic without torch or megatron, so
``lifecycle explain`` can show the groups of any rank of a 16k-rank job in milliseconds.

Ranks of a group are listed in communicator order: ascending, as ``torch.distributed.new_group``
sorts them (so ``ranks_of`` equals ``get_process_group_ranks`` of the real group). ``group_of`` gives the
same group as a :class:`RankSet` (a base and a few (stride, size) pairs), so one rank's groups and the
number of distinct groups cost O(1) whatever the world size; only ``groups`` lists a whole kind.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lifecycle.errors import UsageError
from lifecycle.policy import installed
from lifecycle.policy.groupnames import GROUP_NAMES, closest

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMS = ("tp", "pp", "dp", "ep", "cp")
MAX_WORLD_SIZE = 2**31 - 1
"""torch.distributed ranks are 32-bit ints."""

# name -> dimensions (a RankGenerator token) in the decoder / expert grid. Gloo twins share ranks.
_DECODER = {
    "dp": "dp", "dp_gloo": "dp", "dp_cp": "dp-cp", "dp_cp_gloo": "dp-cp", "tp": "tp", "pp": "pp",
    "cp": "cp", "mp": "tp-pp", "tp_cp": "tp-cp", "tp_dp": "tp-dp", "tp_dp_cp": "tp-dp-cp",
}
_EXPERT = {"ep": "ep", "etp": "tp", "edp": "dp", "edp_gloo": "dp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp",
           "tp_ep_pp_egtp": "tp-ep-pp"}  # the ranks of tp-ep-pp while lifecycle leaves expert GTP at 1


@dataclass(frozen=True)
class RankSet:
    """The ranks ``base + sum(k_i * stride_i)`` for ``0 <= k_i < size_i``: one group, without listing it.

    ``dims`` is canonical (sorted by stride, size-1 dims dropped, a dim merged into the one below when it
    continues it), so two sets are equal exactly when their ranks are. Every group of a Megatron layout has
    this form, with each stride at least the span of the dims below it ("digits" that never overlap).
    """

    base: int
    dims: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of(base: int, dims: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> RankSet:
        out: list[tuple[int, int]] = []
        for stride, size in sorted(d for d in dims if d[1] > 1):
            if out and out[-1][0] * out[-1][1] == stride:
                out[-1] = (out[-1][0], out[-1][1] * size)
            else:
                out.append((stride, size))
        return RankSet(base, tuple(out))

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.dims)

    @property
    def last(self) -> int:
        return self.base + sum(s * (n - 1) for s, n in self.dims)

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        rest = rank - self.base
        for stride, size in reversed(self.dims):  # digits never overlap: the top one is forced
            k = rest // stride if rest >= 0 else -1
            if not 0 <= k < size:
                return False
            rest -= k * stride
        return rest == 0

    def __iter__(self) -> Iterator[int]:
        """The ranks in ascending order (the highest stride is the most significant digit)."""
        for ks in itertools.product(*(range(n) for _, n in reversed(self.dims))):
            yield self.base + sum(k * s for k, (s, _) in zip(ks, reversed(self.dims), strict=True))

    def fmt(self, limit: int = 16) -> str:
        """The same text as :func:`lifecycle.distributed.ranks.fmt_ranks` of the listed ranks, in O(limit)."""
        if self.size > 4 and len(self.dims) == 1 and self.dims[0][0] > 1:
            return f"{self.base},{self.base + self.dims[0][0]},...,{self.last}"
        run = self.dims[0][1] if self.dims and self.dims[0][0] == 1 else 1
        starts = RankSet(self.base, self.dims[1:] if run > 1 else self.dims)
        parts = [str(a) if run == 1 else f"{a}-{a + run - 1}" for a in itertools.islice(starts, limit)]
        more = starts.size - limit
        return ",".join(parts) + (f",... (+{more} more)" if more > 0 else "")


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

    def rankset(self, rank: int, token: str, extra: tuple[tuple[int, int], ...] = ()) -> RankSet:
        """:meth:`group_of` as a RankSet, in O(dims)."""
        masked = self._masked(token)[0]
        return RankSet.of(self.base(rank, token), [(self.stride[i], self.shape[i]) for i in masked] + list(extra))

    def coord(self, rank: int, dim: str) -> tuple[int, int]:
        """(the rank's coordinate along ``dim``, the stride of ``dim``)."""
        i = self.dims.index(dim)
        return (rank // self.stride[i]) % self.shape[i], self.stride[i]

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
                 dist_opt_instances: int, order: str, gtp: bool | None = None) -> None:
        self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp = world_size, tp, pp, cp, ep, etp
        self.dist_opt_instances, self.order = dist_opt_instances, order
        self.gtp = installed.gtp_groups() if gtp is None else gtp
        """Whether megatron-core makes the generalized-tensor-parallel groups (0.19+; by default: the installed one)."""
        self.dp = world_size // (tp * pp * cp)
        self.edp = world_size // (etp * ep * pp)
        self.intra_edp = self.edp // dist_opt_instances
        self._dec = _Grid({"tp": tp, "pp": pp, "dp": self.dp, "ep": 1, "cp": cp}, order)
        self._exp = _Grid({"tp": etp, "pp": pp, "dp": self.edp, "ep": ep, "cp": 1}, order)

    def __repr__(self) -> str:
        return (f"Layout(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, "
                f"ep={self.ep}, etp={self.etp}, dp={self.dp}, edp={self.edp}, "
                f"dist_opt_instances={self.dist_opt_instances}, order={self.order!r}, gtp={self.gtp})")

    @property
    def sizes(self) -> dict[str, int]:
        """The parallel sizes by name (tp, pp, cp, ep, etp, dp, edp, dist_opt_instances)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp,
                "dp": self.dp, "edp": self.edp, "dist_opt_instances": self.dist_opt_instances}

    def exists(self, name: str) -> bool:
        """Whether Megatron creates groups of this kind at all in this layout."""
        check_name(name)
        if name == "tp_ep_pp_egtp":
            return self.gtp
        return name not in ("inter_dist_opt",) or self.dist_opt_instances > 1

    def groups(self, name: str) -> list[list[int]]:
        """All groups of kind ``name`` in Megatron's creation order; [] if the kind does not exist."""
        check_name(name)
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
        if name == "intra_dp_cp":
            return [list(g) for g in self._dec_chunks()]
        return [g for e in self._exp.groups("dp") for g in self._split_edp(e, name)]

    def ranks_of(self, name: str, rank: int) -> list[int] | None:
        """The ranks of the ``name`` group that contains ``rank``, or None if it is in none."""
        group = self.group_of(name, rank)
        return None if group is None else list(group)

    def group_of(self, name: str, rank: int) -> RankSet | None:
        """:meth:`ranks_of` as a RankSet: O(1) in the world size."""
        check_name(name)
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside world size {self.world_size}")
        if not self.exists(name):
            return None
        if name == "world":
            return RankSet.of(0, [(1, self.world_size)])
        if name in _DECODER:
            return self._dec.rankset(rank, _DECODER[name])
        if name in _EXPERT:
            return self._exp.rankset(rank, _EXPERT[name])
        if name in ("embd", "pos_embd"):
            pp = self._dec.rankset(rank, "pp")
            ends = [pp.base] if name == "pos_embd" or pp.size == 1 else [pp.base, pp.last]
            return RankSet.of(ends[0], [(ends[-1] - ends[0], len(ends))]) if rank in ends else None
        if name == "intra_dp_cp":
            return self._intra_dp_cp(self._dec.rankset(rank, "dp-cp"), rank)
        # The distributed-optimizer groups split the expert-dp dim into (intra_edp, instances).
        c, stride = self._exp.coord(rank, "dp")
        chunk, size = c // self.intra_edp, self.intra_edp
        if name == "intra_edp":
            return RankSet.of(self._exp.base(rank, "dp") + chunk * size * stride, [(stride, size)])
        if name == "inter_dist_opt":
            return RankSet.of(self._exp.base(rank, "dp") + c % size * stride,
                              [(stride * size, self.dist_opt_instances)])
        return self._exp.rankset(rank - (c - chunk * size) * stride, "tp-cp-ep-pp", ((stride, size),))

    def communicators_of(self, rank: int) -> int:
        """How many process groups this rank is a member of after megatron-core's ``initialize_model_parallel``
        (its defaults: gloo twins on, no all-gather, hierarchical-cp or SHARP groups), the default group included:
        one per group object, so two kinds count once only where Megatron hands out the same object (intra_edp is
        edp with one distributed-optimizer instance), and a gloo twin counts apart from its NCCL group. O(1).

        Per rank Megatron (0.16) creates: dp_cp, dp, edp with their gloo twins; cp, mp, tp, pp, tp_dp_cp, tp_dp,
        tp_cp, ep, etp, tp_ep, tp_ep_pp, intra_dist_opt; the embedding group (first and last stage) and
        the position-embedding group (first stage) of its pipeline; with instances > 1 also the
        intra-instance dp_cp group, intra_edp and inter_dist_opt, each with a gloo twin. 0.19 adds three
        (:attr:`gtp`): the dense and the expert generalized-tensor-parallel groups (one rank each while their size
        is 1) and tp_ep_pp_egtp.
        """
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside world size {self.world_size}")
        count = 1 + 2 * 3 + 12  # world; dp_cp, dp, edp and their twins; the twelve single groups above
        if self.gtp:
            count += 3
        if self.dist_opt_instances > 1:
            count += 3 * 2
        return count + sum(self.group_of(name, rank) is not None for name in ("embd", "pos_embd"))

    def count_distinct_groups(self) -> int:
        """How many distinct rank sets all group kinds make together (what ``groups`` would list), in O(1).

        Every kind but the embedding ones splits the world into translates of its rank-0 group, and a split
        of [0, world) into translates of one set is unique, so two kinds give the same groups exactly when
        their rank-0 groups are equal. Embedding groups split the world only when pp <= 2 (pos_embd when
        pp = 1); otherwise they are one per pipeline: pairs no split has, singletons any split of size 1 has.
        """
        splits: set[tuple[tuple[int, int], ...]] = set()
        pipelines = self.world_size // self.pp
        partial = {"embd": self.pp > 2, "pos_embd": self.pp > 1}
        for name in GROUP_NAMES:
            group = self.group_of(name, 0)
            if group is not None and not partial.get(name, False):
                splits.add(group.dims)
        total = sum(self.world_size // math.prod(n for _, n in dims) for dims in splits)
        if partial["embd"]:
            total += pipelines
        if partial["pos_embd"] and () not in splits:
            total += pipelines
        return total

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

    def _intra_dp_cp(self, dp_cp: RankSet, rank: int | None = None, index: int | None = None) -> RankSet:
        # Megatron: consecutive chunks of (dp*cp)/instances of each dp-cp group's ranks in ascending order.
        size = dp_cp.size // self.dist_opt_instances
        pos = sum(k * math.prod(n for _, n in dp_cp.dims[:i]) for i, k in enumerate(_digits(dp_cp, rank))) \
            if rank is not None else 0
        return chunk(dp_cp, size, pos // size if index is None else index)

    def _dec_chunks(self) -> list[RankSet]:
        out = []
        for g in self._dec.groups("dp-cp"):
            rs = self._dec.rankset(g[0], "dp-cp")
            out += [self._intra_dp_cp(rs, index=k) for k in range(self.dist_opt_instances)]
        return out

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


def _digits(rs: RankSet, rank: int) -> list[int]:
    """The digit of ``rank`` on each of ``rs``'s dims (lowest stride first)."""
    rest, out = rank - rs.base, []
    for stride, _ in reversed(rs.dims):
        out.append(rest // stride)
        rest -= out[-1] * stride
    return out[::-1]


def chunk(rs: RankSet, size: int, index: int) -> RankSet:
    """The ``index``-th run of ``size`` consecutive ranks of ``rs`` in ascending order, as a RankSet. A UsageError
    when the run is not a box of ``rs``'s dims (a chunk size that neither divides nor is a multiple of a dim)."""
    dims, base, rem, pos = [], rs.base, size, index * size
    for stride, n in rs.dims:
        digit, pos = pos % n, pos // n
        if rem >= n:
            if rem % n:
                raise UsageError(f"a run of {size} ranks of {rs.fmt()} is not a grid of its dims")
            dims.append((stride, n))
            rem //= n
        elif rem > 1:
            if n % rem:
                raise UsageError(f"a run of {size} ranks of {rs.fmt()} is not a grid of its dims")
            dims.append((stride, rem))
            base += digit * stride
            rem = 1
        else:
            base += digit * stride
    return RankSet.of(base, dims)


def check_name(name: str) -> None:
    """A UsageError for a name that is not in ``names.GROUP_NAMES`` (with a "did you mean")."""
    if name not in GROUP_NAMES:
        hint = closest(name)
        raise UsageError(f"unknown group name {name!r}"
                         + (f"; did you mean {hint!r}?" if hint else f". Available names: {', '.join(GROUP_NAMES)}"))


def build_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None, dist_opt_instances: int = 1,
                 order: str = DEFAULT_ORDER, *, gtp: bool | None = None) -> Layout:
    """Check the sizes as Megatron's ``initialize_model_parallel`` does and return the layout.

    Raises UsageError naming the sizes and the broken rule when Megatron would refuse them. ``gtp``: whether the
    layout has megatron-core 0.19's generalized-tensor-parallel groups (None: as the installed megatron-core does).
    """
    etp = tp if etp is None else etp
    given = {"world size": world_size, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp,
             "dist_opt_instances": dist_opt_instances}
    bad = {k: v for k, v in given.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise UsageError(f"parallel sizes must be integers >= 1, got {bad}")
    if world_size > MAX_WORLD_SIZE:
        raise UsageError(f"world size {world_size} is larger than {MAX_WORLD_SIZE} (torch.distributed ranks "
                         f"are 32-bit ints); give a smaller world size")
    _divisible(world_size, tp * pp * cp, "world size", "tp*pp*cp", f" (tp={tp}, pp={pp}, cp={cp})")
    _divisible(world_size, etp * ep * pp, "world size", "etp*ep*pp", f" (etp={etp}, ep={ep}, pp={pp})")
    dp, edp = world_size // (tp * pp * cp), world_size // (etp * ep * pp)
    _divisible(dp * cp, dist_opt_instances, "dp*cp", "dist_opt_instances")
    _divisible(edp, dist_opt_instances, "expert dp (world/(etp*ep*pp))", "dist_opt_instances")
    _check_order(order, {"tp": tp, "pp": pp, "dp": dp, "ep": 1, "cp": cp}, "dense")
    _check_order(order, {"tp": etp, "pp": pp, "dp": edp, "ep": ep, "cp": 1}, "expert")
    layout = Layout(world_size, tp, pp, cp, ep, etp, dist_opt_instances, order, gtp)
    if pp > 1 and not order.endswith("pp"):
        _check_pp_agrees(layout)
    return layout


def of_policy(policy: Policy, world_size: int) -> Layout:
    """:func:`build_layout` for ``policy``'s parallelism at ``world_size`` (a UsageError where Megatron's rules
    refuse it)."""
    par = policy.parallelism
    return build_layout(world_size, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, etp=par.etp,
                        dist_opt_instances=par.dist_opt_instances, order=par.order)


def _check_pp_agrees(layout: Layout) -> None:
    # Megatron asserts both grids give the same pipeline groups; with pp last they always do.
    if layout.dp != layout.edp:
        raise UsageError(f"order {layout.order!r} does not end with pp, so dp ({layout.dp}) must equal "
                         f"expert dp ({layout.edp}); put pp last or change etp/ep")
    if layout._dec.rankset(0, "pp") != layout._exp.rankset(0, "pp"):  # equal splits: see count_distinct_groups
        raise UsageError(f"order {layout.order!r} gives different pipeline groups for the dense and "
                         f"expert parts; put pp last")

