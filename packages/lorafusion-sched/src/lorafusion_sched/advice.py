"""Advice on a finished plan: when no-ops take a notable share of it, which adapters cause them and what helps.

No-ops come from the bubble lemma: between the last microbatch of an adapter's global batch ``g``
and the first of ``g + 1`` lie at least ``S - 1`` rounds (of ``d`` microbatches each with ``d``
data-parallel replicas), so that ``g``'s optimizer step happens before ``g + 1`` reads the weights.
Other adapters' microbatches fill those rounds; an adapter left alone at the end of a plan, after
the others have run out of samples, has nothing to fill them with, and they become no-ops.
"""

from __future__ import annotations

from lorafusion_sched.models import Plan

__all__ = ["NOOP_COUNT_WARNING", "NOOP_SHARE_WARNING", "noop_advice"]

NOOP_SHARE_WARNING = 0.2
"""The share of no-op microbatches above which :func:`noop_advice` speaks (and ``plan`` warns)."""

NOOP_COUNT_WARNING = 16
"""The fewest no-ops :func:`noop_advice` speaks of: a small plan (the docs' ten-line example has 5 of 9)
always ends with a few, and they cost a few microbatches' time."""


def _tail(plan: Plan, noops: list[int]) -> tuple[list[str], int]:
    """The fewest adapters finishing last such that at least half the no-ops come after all others ended.

    Returns:
        Their names (in the jobs' order) and how many no-ops come after every other adapter's end.
    """
    last: dict[str, int] = {}
    for index, mb in enumerate(plan.microbatches):
        for segment in mb.segments:
            last[segment.adapter] = index
    finishing = sorted(last, key=lambda name: -last[name])
    order = [a.name for a in plan.adapters]
    count, after = len(finishing), len(noops)
    for k in range(1, len(finishing)):
        after_k = sum(1 for index in noops if index > last[finishing[k]])
        if 2 * after_k >= len(noops):
            count, after = k, after_k
            break
    return sorted(finishing[:count], key=order.index), after


def noop_advice(plan: Plan, *, cost_model_given: bool = False) -> str | None:
    """What to tell the user when more than :data:`NOOP_SHARE_WARNING` of the plan's microbatches are no-ops.

    Args:
        plan: A finished plan.
        cost_model_given: Whether the plan was made with ``PlanOptions.cost_model``; if not, the
            first remedy named is to give one (the planner then splits lone global batches where
            that is faster: :mod:`lorafusion_sched.lone_batches`).

    Returns:
        One paragraph naming the share, the adapters left running alone at the end (where the
        no-ops are) and the remedies; ``None`` at or below the share, or below
        :data:`NOOP_COUNT_WARNING` no-ops.
    """
    total = len(plan.microbatches)
    noops = [index for index, mb in enumerate(plan.microbatches) if mb.noop]
    if len(noops) <= NOOP_SHARE_WARNING * total or len(noops) < NOOP_COUNT_WARNING:
        return None
    names, after = _tail(plan, noops)
    stages, d = plan.pipeline_stages, plan.data_parallel
    lemma = (
        f"by the bubble lemma, the first microbatch of an adapter's next global batch comes at least "
        f"pipeline_stages = {stages} positions after the last microbatch of its previous one"
        if d == 1
        else f"by the bubble lemma, the first round of an adapter's next global batch comes at least "
        f"pipeline_stages = {stages} rounds after the last round of its previous one, a round being {d} "
        f"microbatches (one per replica)"
    )
    share = f"{len(noops):,} of {total:,} microbatches ({len(noops) / total:.0%}) are no-ops"
    quoted = " and ".join(repr(name) for name in names)
    larger = "a larger global_batch_size (fewer global batches, so fewer waits)"
    if len(names) == len(plan.adapters) == 1:
        what = f"{share}: {quoted} is the plan's only adapter, and {lemma}; only other adapters could fill the gap"
        remedies = [f"give {quoted} {larger}", "plan another job together with it"]
    elif len(names) >= len(plan.adapters):
        what = f"{share}, spread over the plan: {lemma}, and the adapters' microbatches are too few to fill the gaps"
        remedies = ["give the adapters larger global batches (fewer waits)", "plan more jobs together"]
    else:
        alone = f"{quoted} runs alone" if len(names) == 1 else f"only {quoted} are left"
        what = (
            f"{share}, {after:,} of them after the other adapters have finished and {alone}: {lemma}, and only "
            f"other adapters' microbatches can fill the gap"
        )
        remedies = [
            f"give {quoted} {larger}",
            "give the other adapters more samples or plan another job with them, so that all run out together",
        ]
    if not cost_model_given:
        remedies.insert(
            0,
            "give the planner a cost model (options cost_model, as `lorafusion-megatron profile` measures one): it "
            "then splits the global batches that run alone into smaller microbatches where that is faster, which "
            "does not change the training",
        )
    if d > 1:
        remedies.append("plan for fewer data-parallel replicas")
    return f"{what}. What helps: {'; '.join(remedies)}; or accept the no-ops (docs: 'Lone adapters and no-ops')"
