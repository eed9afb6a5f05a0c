"""Zero-bubble orders from costs: the fastest order found for given F, B, W, transfer times and memory."""

from __future__ import annotations

# The zero-bubble family (``zb-h1``, ``zbv``, ``interleaved-zb``, ``dualpipev``) takes ``costs=``: the
# plan's per-stage forward, input-grad and weight-grad times and each boundary's transfer time, as
# plain numbers (or a ``schedules.Costs``), and ``max_live=``: the most stage-microbatches a rank may
# hold at once (from a forward's start until its weight pass ends), the memory limit in the unit
# every schedule's memory is counted in.
#
# How the order is found, and why this way:
#
# - **A list scheduler over the real times** (``_list.list_schedule``): each idle rank starts the
#   most urgent action whose inputs have arrived. This is the zero-bubble paper's automatic
#   scheduler in spirit (Qi et al., 2024, section 3: a greedy that places F and B as early as memory
#   allows and fills the gaps with W), but run in continuous time on the true durations, so a
#   B that costs twice the F, a slow stage or a slow link shapes the order instead of a unit grid.
# - **A small search over urgencies**: which of a rank's F and B passes (per stage of the rank) go
#   first is not knowable in advance for uneven costs, so every ordering of those classes is tried
#   (24 for two stages per rank; a structured few beyond), each with microbatches taken oldest
#   first or class first, with W passes filling gaps, freeing memory first at the limit, or in
#   turn (``list_schedule``'s ``w_mode``). The best four are run again with a bounded lead of a
#   rank's stage over its next one (the warm-up shapes of PyTorch's V and interleaved orders: with
#   slow links this is what keeps the V's second leg fed), and the best four after that at one below
#   the memory limit (holding back a warm-up forward sometimes shortens the cool-down), with
#   patience (a rank waits for a more urgent action arriving within half or all of the ready one's
#   duration) and with more, less or no room reserved for the rank's later stages. Candidates are ranked by their makespan (``simulate`` never gives an
#   order more); ties keep the earlier one, so every rank builds the same table.
# - **Seeds: a portfolio with the hand-built orders.** The family's fixed order (the unit-cost table,
#   and for ``dualpipev`` DeepSeek's order) and the order PyTorch's schedule of the same family
#   generates (``schedules.hand_orders``: its interleaved zero-bubble loop, its ZBV order, rebuilt
#   natively) are candidates too, timed with the same costs and kept only where they fit the memory
#   limit. The order from costs is thereby never slower on the simulator than the fixed one, nor than
#   PyTorch's, for the same costs and memory (``tests/engine/test_torch_orders.py`` over p = 2, 4, 8 and
#   m = p, 2p, 4p); the search is what wins where costs are uneven (stages of unequal cost, slow
#   links: 2-14 % below PyTorch's order in ``benchmarks/torch_orders.py``). A seed's makespan is also
#   the first bound of the search, so candidates worse than it are abandoned early. From 256
#   stage-microbatches up (16 stages x 16 microbatches) the last refinement round (72 runs) is left
#   out: it took 42 s of one layout of a 16-stage, 32-microbatch zb-h1 plan (Llama-7B on 64 GPUs)
#   and the seeds already keep the order no slower than PyTorch's. From 2,048 up (64 stages x 32
#   microbatches) only the seeds are timed: the planner rebuilds the order for every split it tries.
# - **A screen: the seeds alone** (the option ``search=False``): only the seeds are timed with the
#   costs, no list scheduling. Its makespan bounds the searched order's from above (the search keeps
#   the seeds among its candidates), at the price of a few simulations: the planner screens the
#   layouts of a search with it and builds the searched order for the ones it makes exact.
#
# An exact solver (an ILP as in the ZB paper's appendix) finds optimal orders for small cases but
# takes seconds to minutes per layout; the planner evaluates tens of layouts, and the portfolio above
# lands within 2-10 % of the busiest rank's compute time for B = 2F (``benchmarks/torch_orders.py``).
# A candidate is abandoned as soon as one of its actions would end after the best makespan so far.
# Results are cached per input.

import functools
import itertools
from collections.abc import Sequence

from schedules._list import Key, Order, Times, list_schedule
from schedules.action import Action, B, F, W
from schedules.costs import Costs
from schedules.errors import ScheduleError
from schedules.simulate import simulate
from schedules.table import Table

__all__ = ["CostsOption", "build_from_costs", "costs_of", "option_costs", "order_for", "parse_times", "rank_limits",
           "search_option"]

CostsOption = Costs | Sequence[object] | None  # what a schedule's ``costs=`` option takes
_W_MODES = ("fill", "free", "key")  # see list_schedule
_REFINE = 4  # the best urgency orders tried again under other memory limits, patience and reservation
_LARGE = 256  # stage-microbatches from which only the urgency orders and their leads are tried (see below)
_HUGE = 2048  # stage-microbatches from which only the seeds are timed: no list scheduling at all


def parse_times(schedule: str, costs: CostsOption, num_stages: int) -> Times:
    """The option as (forward, backward_input, backward_weight, transfer) tuples of ``num_stages``."""
    if isinstance(costs, Costs):
        static = costs.static_memory
        costs.check(num_stages, len(static) if isinstance(static, tuple) else 1)
        return (tuple(costs.compute_time(Action(s, F, 0)) for s in range(num_stages)),
                tuple(costs.compute_time(Action(s, B, 0)) for s in range(num_stages)),
                tuple(costs.compute_time(Action(s, W, 0)) for s in range(num_stages)),
                tuple(costs.transfer_time(s) for s in range(num_stages)))
    if not isinstance(costs, Sequence) or isinstance(costs, str) or len(costs) not in (3, 4):
        raise ScheduleError(
            f"{schedule}: costs must be a schedules.Costs or (forward, backward_input, "
            f"backward_weight[, transfer]) with a number or one per stage each, got {costs!r}")
    parts = [_per_stage(schedule, name, value, num_stages)
             for name, value in zip(("forward", "backward_input", "backward_weight", "transfer"),
                                    (*costs, 0.0) if len(costs) == 3 else costs)]
    return parts[0], parts[1], parts[2], parts[3]


def _per_stage(schedule: str, name: str, value: object, num_stages: int) -> tuple[float, ...]:
    values = value if isinstance(value, Sequence) and not isinstance(value, str) else (value,) * num_stages
    if len(values) != num_stages or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ScheduleError(f"{schedule}: costs' {name} must be one number >= 0 or {num_stages} "
                            f"(one per stage), got {value!r}")
    return tuple(float(v) for v in values)


def rank_limits(schedule: str, max_live: object, default: Sequence[int], stages_per_rank: int
                ) -> tuple[int, ...]:
    """``max_live`` (None, one int, or one per rank) as one limit per rank."""
    if max_live is None:
        return tuple(default)
    values = max_live if isinstance(max_live, Sequence) else (max_live,) * len(default)
    if len(values) != len(default) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= stages_per_rank for v in values):
        raise ScheduleError(
            f"{schedule}: max_live must be an int >= {stages_per_rank} (the stages of a rank) or one per "
            f"rank ({len(default)}), got {max_live!r}")
    return tuple(values)


def costs_of(times: Times) -> Costs:
    """The simulator's costs for these times (transfers as per-boundary latencies)."""
    forward, backward, weight, transfer = times
    return Costs(forward=forward, backward_input=backward, backward_weight=weight,
                 comm_latency=0.0, comm_bandwidth=1.0, activation_bytes=transfer)


def _chunk_of(stage_to_rank: Sequence[int]) -> tuple[int, ...]:
    """Each stage's position among its rank's stages (0 = the rank's first stage)."""
    seen: dict[int, int] = {}
    chunks = []
    for rank in stage_to_rank:
        chunks.append(seen.get(rank, 0))
        seen[rank] = chunks[-1] + 1
    return tuple(chunks)


def _keys(stage_to_rank: Sequence[int]) -> list[Key]:
    """Urgency orders to try: every order of the (kind, chunk) classes of F and B (a structured
    few past two chunks), microbatch first or class first; W passes oldest first."""
    chunk = _chunk_of(stage_to_rank)
    v = max(chunk) + 1
    classes = [(kind, c) for kind in (B, F) for c in range(v)]
    if len(classes) <= 4:
        orders = list(itertools.permutations(classes))
    else:  # B before F; later chunks first or earlier first, and F before B likewise
        down, up = list(range(v)), list(range(v - 1, -1, -1))
        orders = [tuple((k, c) for k in kinds for c in cs)
                  for kinds in ((B, F), (F, B)) for cs in (down, up)]
    keys: list[Key] = []
    for order in orders:
        rank_of = {cls: n for n, cls in enumerate(order)}
        rank_of.update({(W, c): len(order) + c for c in range(v)})
        keys.append(_key(rank_of, chunk, by_class=True))
        keys.append(_key(rank_of, chunk, by_class=False))
    return keys


def _leads(stage_to_rank: Sequence[int]) -> list[tuple[int, ...]]:
    """How far (in microbatches) a rank's stage may run its forwards ahead of the rank's next stage: the
    warm-ups of PyTorch's V (2(p-r)-1) and interleaved (p + 2(p-1-r)) orders, and a group of p."""
    p = max(stage_to_rank) + 1
    return [tuple(2 * (p - r) - 1 for r in range(p)), tuple(2 * (p - r) for r in range(p)), (p,) * p,
            tuple(p + 2 * (p - 1 - r) for r in range(p))]


def _key(rank_of: dict[tuple[str, int], int], chunk: Sequence[int], *, by_class: bool) -> Key:
    if by_class:
        return lambda kind, s, i: (rank_of[(kind, chunk[s])], i)
    return lambda kind, s, i: (i if kind != W else 1 << 30, rank_of[(kind, chunk[s])])


@functools.lru_cache(maxsize=256)
def build_from_costs(
    stage_to_rank: tuple[int, ...], num_microbatches: int, times: Times, live_limit: tuple[int, ...],
    seeds: tuple[Table, ...] = (), search: bool = True,
) -> Table:
    """The fastest order found for these times and per-rank limits (how: the comment atop this file);
    with ``search=False`` the fastest seed that fits (the search's upper bound), searched only if none does."""

    costs = costs_of(times)
    found: list[tuple[float, int, Table]] = []
    for n, table in enumerate(seeds):
        try:
            sim = simulate(table, costs)
        except ScheduleError:  # a hand-built order that deadlocks for these counts is no candidate
            continue
        if all(p <= q for p, q in zip(sim.peak_live, live_limit)):
            found.append((sim.makespan, n, table))
    local = max(_chunk_of(stage_to_rank)) + 1
    tried: list[tuple[float, int, Table, dict[str, object]]] = []

    def run(policies: list[dict[str, object]]) -> None:
        for policy in policies:
            limit = policy.get("live_limit", live_limit)
            bound = min((r[0] for r in (*found, *tried)), default=float("inf"))
            try:
                done = list_schedule(stage_to_rank, num_microbatches, times,
                                     **{**policy, "live_limit": limit, "bound": bound})  # type: ignore[arg-type]
            except ScheduleError:
                continue
            if done is not None:
                tried.append((done.makespan, len(seeds) + len(tried), done, policy))

    def best(count: int) -> list[dict[str, object]]:
        return [policy for *_, policy in sorted(tried, key=lambda r: r[:2])[:count]]

    if found and (not search or len(stage_to_rank) * num_microbatches >= _HUGE):  # 64 stages x 512 microbatches: 100 k actions
        return _best(found, tried, live_limit, stage_to_rank)    # a run, rebuilt for every split tried
    run([{"key": key, "w_mode": mode} for key in _keys(stage_to_rank) for mode in _W_MODES])
    run([{**policy, "lead": lead} for policy in best(2 * _REFINE) for lead in _leads(stage_to_rank)])
    if len(stage_to_rank) * num_microbatches >= _LARGE:  # a 16-stage, 32-microbatch zb-h1 spent 42 s of a
        return _best(found, tried, live_limit, stage_to_rank)     # layout's planning in the 72 runs below
    lower = tuple(x - 1 for x in live_limit)
    limits = [live_limit] + ([lower] if min(lower) > local else [])
    run([{**policy, "live_limit": limit, "patience": wait, "reserve": hold} for policy in best(_REFINE)
         for limit, wait, hold in itertools.product(limits, (0.0, 0.5, 1.0), ("one", "none", "ramp"))])
    return _best(found, tried, live_limit, stage_to_rank)


def _best(found: list, tried: list, live_limit: tuple[int, ...], stage_to_rank: tuple[int, ...]) -> Table:
    """The fastest of the seeds (`found`) and the searched orders (`tried`); ties keep the earlier one."""
    found = found + [(span, n, order) for span, n, order, _ in tried]
    if not found:
        local = max(_chunk_of(stage_to_rank)) + 1
        raise ScheduleError(
            f"no order fits max_live {list(live_limit)} with stages on ranks {list(stage_to_rank)}; "
            f"allow at least {local} live stage-microbatches per rank")
    kept = min(found, key=lambda r: r[:2])[2]
    return kept.table() if isinstance(kept, Order) else kept



def order_for(name: str, fixed: Table, options: dict[str, object], *, default_live: Sequence[int] | None = None,
              seeds: Sequence[Table] = ()) -> Table:
    """``fixed`` when neither ``costs`` nor ``max_live`` is given, else the order built from them
    (unit costs when only ``max_live`` is), with ``fixed`` and ``seeds`` among the candidates.
    ``max_live`` defaults to ``default_live``, else to what ``fixed`` holds per rank. The option
    ``search`` (default True) is ``build_from_costs``'s: False times the seeds alone (a screen)."""
    if options.get("costs") is None and options.get("max_live") is None:
        return fixed
    placement = fixed.stage_to_rank
    v = max(_chunk_of(placement)) + 1
    times = parse_times(name, option_costs(options, v), fixed.num_stages)
    default = tuple(default_live) if default_live is not None else _unit_peaks(fixed)
    limits = rank_limits(name, options.get("max_live"), default, v)
    return build_from_costs(placement, fixed.num_microbatches, times, limits, (fixed, *seeds),
                            search=search_option(name, options))


@functools.lru_cache(maxsize=64)
def _unit_peaks(fixed: Table) -> tuple[int, ...]:
    """What the fixed order holds per rank (its default ``max_live``), simulated once per table."""
    return tuple(simulate(fixed).peak_live)


def search_option(name: str, options: dict[str, object]) -> bool:
    """The ``search`` option: True (build the order by list scheduling) or False (time the seeds alone)."""
    value = options.get("search", True)
    if not isinstance(value, bool):
        raise ScheduleError(f"{name}: search must be True (search for the order) or False (time the hand-built "
                            f"orders alone), got {value!r}")
    return value


def option_costs(options: dict[str, object], stages_per_rank: int) -> CostsOption:
    """The ``costs`` option, or F = B = W (a stage of a rank holding v costs 1/v) without it."""
    given = options.get("costs")
    return (1.0 / stages_per_rank,) * 3 if given is None else given  # type: ignore[return-value]
