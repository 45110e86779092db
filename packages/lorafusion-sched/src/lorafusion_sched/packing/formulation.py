r"""The two MILPs of the paper (section 5.2), one function per variable or constraint family.

Notation: items (samples) :math:`i` with adapter :math:`a(i)` and length :math:`\ell_i`; bins
(microbatches) :math:`b = 0..B-1`; capacity :math:`C`; padding multiple :math:`P`; :math:`T_a`
the total length of adapter :math:`a`; :math:`r(i)` the rank of item :math:`i` when items are
sorted by decreasing length (ties by index).

Variables: :math:`x_{i,b} \in \{0,1\}` (item in bin), :math:`k_{a,b} \in \{0..C/P\}` (padding
units of adapter :math:`a` in bin :math:`b`), and in stage 1 :math:`z_b \in \{0,1\}` (bin used).

Stage 1 minimises :math:`\sum_b z_b` over at most :math:`B` = the greedy bin count bins (the
authors allowed one bin per item, i.e. quadratically many binaries). Stage 2 fixes :math:`B` and
minimises the padded size :math:`P \sum_a k_{a,B-1}` of the last bin, which symmetry lets us
declare the smallest one; no big-M selector is needed.

The models are plain arrays (:class:`MilpModel`); :mod:`lorafusion_sched.packing.highs` turns them
into a HiGHS model. Nothing here knows about the solver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from lorafusion_sched.packing.problem import Packing, PackingProblem, item_ranks, round_up

__all__ = ["MilpModel", "min_bins_model", "min_smallest_bin_model"]

_INF = float("inf")


@dataclass
class MilpModel:
    """A MILP as arrays: ``min c x`` s.t. ``row_lower <= A x <= row_upper``, bounds, integrality.

    Attributes:
        col_cost, col_lower, col_upper, col_integer: One entry per column.
        row_lower, row_upper: One entry per row.
        entries: ``(row, col, value)`` triples of ``A``.
        col_names: Readable names (``x_3_1`` for item 3 in bin 1) for ``.lp`` dumps.
        x: Column of ``x_{i,b}`` by ``(item, bin)``; missing pairs are fixed to 0 by symmetry.
        k: Column of ``k_{a,b}`` by ``(adapter, bin)``.
        z: Column of ``z_b`` by bin (stage 1 only).
        num_bins: ``B``.
    """

    problem: PackingProblem
    num_bins: int
    col_cost: list[float] = field(default_factory=list)
    col_lower: list[float] = field(default_factory=list)
    col_upper: list[float] = field(default_factory=list)
    col_integer: list[bool] = field(default_factory=list)
    col_names: list[str] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    entries: list[tuple[int, int, float]] = field(default_factory=list)
    x: dict[tuple[int, int], int] = field(default_factory=dict)
    k: dict[tuple[int, int], int] = field(default_factory=dict)
    z: list[int] = field(default_factory=list)

    def add_col(self, name: str, *, lower: float, upper: float, integer: bool, cost: float = 0.0) -> int:
        """Add a column and return its index."""
        self.col_cost.append(cost)
        self.col_lower.append(lower)
        self.col_upper.append(upper)
        self.col_integer.append(integer)
        self.col_names.append(name)
        return len(self.col_cost) - 1

    def add_row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        """Add ``lower <= sum(value * col) <= upper``."""
        row = len(self.row_lower)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.entries.extend((row, c, v) for c, v in terms)

    def encode(self, packing: Packing) -> npt.NDArray[np.float64]:
        """Column values of a packing whose bin ``b`` is ``packing[b]`` (a warm start).

        Raises:
            ValueError: If the packing does not respect the model's symmetry breaking.
        """
        values = np.zeros(len(self.col_cost))
        p = self.problem
        for b, items in enumerate(packing):
            totals: dict[int, int] = {}
            for i in items:
                if (i, b) not in self.x:
                    raise ValueError(f"item {i} cannot sit in bin {b} under the symmetry breaking")
                values[self.x[(i, b)]] = 1.0
                totals[p.adapters[i]] = totals.get(p.adapters[i], 0) + p.lengths[i]
            for a, t in totals.items():
                values[self.k[(a, b)]] = round_up(t, p.padding) // p.padding
            if self.z:
                values[self.z[b]] = 1.0
        return values

    def decode(self, values: npt.NDArray[np.float64]) -> Packing:
        """The packing of a solution: bins with at least one item, in bin order."""
        bins: list[list[int]] = [[] for _ in range(self.num_bins)]
        for (i, b), col in self.x.items():
            if values[col] > 0.5:
                bins[b].append(i)
        return [sorted(items) for items in bins if items]


def _assignment_variables(model: MilpModel, *, free_last_bin: bool) -> None:
    r"""Create :math:`x_{i,b}` only where symmetry breaking allows it.

    .. math:: x_{i,b} = 0 \quad \forall b > r(i)

    Any packing can be relabelled so that bins are ordered by their best-ranked item; then the
    item of rank :math:`r` lies in a bin with index at most :math:`r`. With ``free_last_bin``
    (stage 2) the last bin is reserved for the smallest bin and accepts every item, and the
    ordering applies to the other :math:`B-1` bins.
    """
    rank = item_ranks(model.problem)
    ordered = model.num_bins - 1 if free_last_bin else model.num_bins
    for i in range(model.problem.num_items):
        allowed = list(range(min(rank[i] + 1, ordered)))
        if free_last_bin:
            allowed.append(model.num_bins - 1)
        for b in allowed:
            model.x[(i, b)] = model.add_col(f"x_{i}_{b}", lower=0, upper=1, integer=True)


def _padding_variables(model: MilpModel, cost_of_last_bin: float = 0.0) -> None:
    r"""Create :math:`k_{a,b} \in \{0, \dots, C/P\}`, the padding units of adapter :math:`a` in bin :math:`b`."""
    p = model.problem
    for a in sorted(set(p.adapters)):
        for b in range(model.num_bins):
            cost = cost_of_last_bin if b == model.num_bins - 1 else 0.0
            model.k[(a, b)] = model.add_col(
                f"k_{a}_{b}", lower=0, upper=p.capacity // p.padding, integer=True, cost=cost
            )


def _each_item_once(model: MilpModel) -> None:
    r"""Every item goes to exactly one bin.

    .. math:: \sum_b x_{i,b} = 1 \quad \forall i
    """
    by_item: dict[int, list[tuple[int, float]]] = {}
    for (i, _b), col in sorted(model.x.items()):
        by_item.setdefault(i, []).append((col, 1.0))
    for i in range(model.problem.num_items):
        model.add_row(by_item[i], 1.0, 1.0)


def _adapter_padding(model: MilpModel) -> None:
    r"""An adapter's segment in a bin is padded up to a multiple of :math:`P`.

    .. math:: \sum_{i : a(i) = a} \ell_i \, x_{i,b} \le P \, k_{a,b} \quad \forall a, b
    """
    p = model.problem
    terms: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for (i, b), col in sorted(model.x.items()):
        terms.setdefault((p.adapters[i], b), []).append((col, float(p.lengths[i])))
    for (a, b), row in sorted(terms.items()):
        model.add_row([*row, (model.k[(a, b)], -float(p.padding))], -_INF, 0.0)


def _adapter_volume(model: MilpModel) -> None:
    r"""Valid cut: an adapter needs at least its padded total over all bins.

    .. math:: \sum_b k_{a,b} \ge \lceil T_a / P \rceil \quad \forall a

    It follows from the padding rows and integrality of :math:`k`; stating it lifts the LP bound
    to the volume bound, so a greedy solution that meets that bound is proved optimal at the root.
    """
    p = model.problem
    for a, total in sorted(p.adapter_totals().items()):
        cols = [(model.k[(a, b)], 1.0) for b in range(model.num_bins)]
        model.add_row(cols, float(round_up(total, p.padding) // p.padding), _INF)


def _capacity_if_used(model: MilpModel) -> None:
    r"""A used bin holds at most :math:`C` padded tokens; an unused bin holds nothing.

    .. math:: P \sum_a k_{a,b} \le C \, z_b \quad \forall b
    """
    p = model.problem
    for b in range(model.num_bins):
        cols = [(model.k[(a, b)], float(p.padding)) for a in sorted(set(p.adapters))]
        model.add_row([*cols, (model.z[b], -float(p.capacity))], -_INF, 0.0)


def _capacity(model: MilpModel) -> None:
    r"""Every bin holds at most :math:`C` padded tokens.

    .. math:: P \sum_a k_{a,b} \le C \quad \forall b
    """
    p = model.problem
    for b in range(model.num_bins):
        cols = [(model.k[(a, b)], float(p.padding)) for a in sorted(set(p.adapters))]
        model.add_row(cols, -_INF, float(p.capacity))


def _used_bins_first(model: MilpModel, min_bins: int) -> None:
    r"""Used bins come first, and at least the volume bound of them is used.

    .. math:: z_{b+1} \le z_b \quad \forall b < B - 1, \qquad z_b = 1 \quad \forall b < L

    where :math:`L` is the volume lower bound (the fixings are bounds, not rows).
    """
    for b in range(model.num_bins):
        used = b < min_bins
        model.z.append(model.add_col(f"z_{b}", lower=1 if used else 0, upper=1, integer=True, cost=1.0))
    for b in range(model.num_bins - 1):
        model.add_row([(model.z[b + 1], 1.0), (model.z[b], -1.0)], -_INF, 0.0)


def _smallest_bin_volume(model: MilpModel) -> None:
    r"""Valid cut: the last bin holds what the other :math:`B-1` full bins cannot.

    .. math:: P \sum_a k_{a,B-1} \ge \sum_a \lceil T_a / P \rceil P - (B - 1) C
    """
    p = model.problem
    need = p.padded_volume() - (model.num_bins - 1) * p.capacity
    if need > 0:
        cols = [(model.k[(a, model.num_bins - 1)], float(p.padding)) for a in sorted(set(p.adapters))]
        model.add_row(cols, float(need), _INF)


def min_bins_model(problem: PackingProblem, max_bins: int, min_bins: int) -> MilpModel:
    r"""Stage 1: the fewest bins.

    .. math::
        \min \sum_b z_b \quad \text{s.t.} \quad
        \sum_b x_{i,b} = 1, \;
        \sum_{a(i)=a} \ell_i x_{i,b} \le P k_{a,b}, \;
        P \sum_a k_{a,b} \le C z_b, \;
        z_{b+1} \le z_b

    over :math:`B` = ``max_bins`` bins (the greedy count), with the symmetry breaking and cuts above.

    Args:
        problem: The task.
        max_bins: Bins available (the greedy solution's count).
        min_bins: A lower bound on the bins needed (the volume bound).
    """
    model = MilpModel(problem=problem, num_bins=max_bins)
    _assignment_variables(model, free_last_bin=False)
    _padding_variables(model)
    _used_bins_first(model, min_bins)
    _each_item_once(model)
    _adapter_padding(model)
    _adapter_volume(model)
    _capacity_if_used(model)
    return model


def min_smallest_bin_model(problem: PackingProblem, num_bins: int) -> MilpModel:
    r"""Stage 2: with :math:`B` bins fixed, the smallest possible last (smallest) bin.

    .. math::
        \min \sum_a k_{a,B-1} \quad \text{s.t.} \quad
        \sum_b x_{i,b} = 1, \;
        \sum_{a(i)=a} \ell_i x_{i,b} \le P k_{a,b}, \;
        P \sum_a k_{a,b} \le C

    The objective counts padding units, so it is integral (HiGHS then rounds its bound). Should
    the solver empty the last bin, the packing needs fewer bins, which is better still.

    Args:
        problem: The task.
        num_bins: :math:`B`, the bin count from stage 1 (or greedy).
    """
    model = MilpModel(problem=problem, num_bins=num_bins)
    _assignment_variables(model, free_last_bin=True)
    _padding_variables(model, cost_of_last_bin=1.0)
    _each_item_once(model)
    _adapter_padding(model)
    _adapter_volume(model)
    _capacity(model)
    _smallest_bin_volume(model)
    return model
