"""The process's traced and stitched joints: a model planned again traces, stitches and checks none again, the
tables stay bounded, big constants stay out."""
from __future__ import annotations

import torch

import ir
import ir.autodiff as ir_autodiff
from engine.planning import joints as joints_mod
from engine.planning.joints import JOINTS, STITCHED, SharedJoints, Stitched, WorkshopJoints
from engine.planning.artifacts import Workshop
from engine.planning.search import search
from tests.mpi.passes import mlp_loss


def _planned(monkeypatch, params, x, y, **options):
    traced = []
    real = ir_autodiff._trace_joint

    def counting(*args):
        traced.append(args[0])
        return real(*args)

    monkeypatch.setattr(ir_autodiff, "_trace_joint", counting)
    found = search(mlp_loss, params, x, y, world_size=2, microbatches=4, **options)
    programs = [str(s.ad.forward) + str(s.ad.backward_input) + str(s.ad.backward_weight) for s in found.stages]
    monkeypatch.setattr(ir_autodiff, "_trace_joint", real)
    return len(traced), programs


def test_a_model_planned_again_traces_no_joint_and_runs_the_same_programs(monkeypatch) -> None:
    torch.manual_seed(0)
    params = {"layers": [torch.randn(16, 16, dtype=torch.float64) / 4 for _ in range(4)]}
    x, y = torch.randn(32, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)
    JOINTS.clear(), STITCHED.clear()
    first, programs = _planned(monkeypatch, params, x, y, schedule="1f1b")
    again, same = _planned(monkeypatch, params, x, y, schedule="1f1b")
    other, _ = _planned(monkeypatch, params, x, y, schedule="zb-h1")  # another schedule: the same blocks
    assert first > 0 and again == 0 and other == 0 and same == programs, (first, again, other)
    JOINTS.clear(), STITCHED.clear()
    assert _planned(monkeypatch, params, x, y, schedule="1f1b")[0] == first  # the count is the tables' doing


def test_the_table_keeps_the_most_recently_used_and_no_graph_with_big_constants(monkeypatch) -> None:
    def graph(const: torch.Tensor) -> ir.Graph:
        return ir.trace(lambda p, x: ((x @ const.T) * p).sum(), torch.ones(const.shape[0], dtype=const.dtype),
                        torch.ones(2, const.shape[-1], dtype=const.dtype))

    small = [graph(torch.full((1, 4), float(k))) for k in range(3)]
    table = SharedJoints(size=2)
    table["a"], table["b"] = small[0], small[1]
    assert table.get("a") is small[0]  # "a" used last: "b" goes first
    table["c"] = small[2]
    assert "b" not in table and table["a"] is small[0] and table["c"] is small[2] and len(table) == 2
    monkeypatch.setattr(joints_mod, "CONSTANT_BYTES", 1000)
    big = graph(torch.randn(200, 4, dtype=torch.float64))  # 6,400 bytes of constant
    assert joints_mod._constant_bytes(big) == 6400
    table["big"] = big
    assert table.get("big") is None and len(table) == 2


def test_a_joint_traced_under_other_attention_kernels_is_not_found() -> None:
    """A traced scaled_dot_product_attention becomes the kernel the settings allow (sdpa_kernel): a joint is kept
    under the settings it was traced in, and a table under other settings traces afresh."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q = (x @ w).reshape(1, 2, 8, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).sum()

    w, x = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    g = ir.trace(attention, w, x)
    table = SharedJoints()
    joint = ir_autodiff._joint(g, [0], [0], "cpu", table)
    assert table.get(ir_autodiff.joint_key(g, [0], [0], "cpu")) is joint
    with sdpa_kernel(SDPBackend.MATH):
        assert table.get(ir_autodiff.joint_key(g, [0], [0], "cpu")) is None
        math = ir_autodiff._joint(g, [0], [0], "cpu", table)
    ops = lambda j: {e.op for e in j.eqns}  # noqa: E731
    assert any("flash" in op for op in ops(joint)) and not any("flash" in op for op in ops(math)), (ops(joint), ops(math))


def test_a_workshop_keeps_the_joints_the_process_declines(monkeypatch) -> None:
    monkeypatch.setattr(joints_mod, "CONSTANT_BYTES", 1000)
    const = torch.randn(200, 4, dtype=torch.float64)
    g = ir.trace(lambda p, x: ((x @ const.T) * p).sum(), torch.ones(200, dtype=torch.float64),
                 torch.ones(2, 4, dtype=torch.float64))
    shared = SharedJoints()
    mine, other = WorkshopJoints(shared), WorkshopJoints(shared)
    joint = ir_autodiff._joint(g, [0], [0], "cpu", mine)
    key = ir_autodiff.joint_key(g, [0], [0], "cpu")
    assert mine.get(key) is joint and shared.get(key) is None and other.get(key) is None


def test_graphs_that_differ_only_in_a_constant_output_digest_apart() -> None:
    a, b = torch.zeros(8), torch.full((8,), 7.0)
    ga = ir.trace(lambda p, x: ((x * p).sum(), a), torch.ones(8), torch.ones(8))
    gb = ir.trace(lambda p, x: ((x * p).sum(), b), torch.ones(8), torch.ones(8))
    assert ir.format_graph(ga) == ir.format_graph(gb) and ir.program_digest(ga) != ir.program_digest(gb)


def test_a_model_planned_again_stitches_and_checks_no_joint_again(monkeypatch) -> None:
    """The in-process harness plans each example in a Workshop of its own: the stitched joints (and their check on
    the stage's strides) of an earlier Workshop serve it, and the programs are the same."""
    from engine.execution.inprocess import build_steps
    from engine.planning.plan import Plan, StagePlan
    from ir import stitch

    torch.manual_seed(0)
    params = {"layers": [torch.randn(16, 16, dtype=torch.float64) / 4 for _ in range(4)]}
    x, y = torch.randn(32, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)
    n = len(ir.trace(mlp_loss, params, x[:8], y[:8]).eqns)
    plan = Plan("1f1b", 2, 2, 1, 4, (n // 2,), tuple(StagePlan(k, 0, 0, k) for k in range(2)))
    calls = {"stitched_joint": 0, "check_runs": 0}
    for name in calls:
        real = getattr(stitch, name)
        monkeypatch.setattr(stitch, name, lambda *a, _real=real, _name=name, **kw: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **kw))[1])

    def programs() -> list[str]:
        steps = build_steps(mlp_loss, params, (x, y), plan)
        return [str(s.ad.forward) + str(s.ad.backward_input) + str(s.ad.backward_weight)
                for s in steps[0].planned.stages]

    JOINTS.clear(), STITCHED.clear()
    first, made = programs(), dict(calls)
    again = programs()
    assert made["stitched_joint"] > 0 and made["check_runs"] > 0, made
    assert calls == made and again == first, (calls, made)  # nothing stitched or checked the second time
    STITCHED.clear()
    programs()
    assert calls["stitched_joint"] == 2 * made["stitched_joint"]  # the count is the table's doing


def test_the_stitched_table_is_bounded_by_the_equations_and_constants_it_holds(monkeypatch) -> None:
    g = ir.trace(lambda p, x: (x * p).sin().sum(), torch.ones(4), torch.ones(4))
    table = SharedJoints(size=2 * (1 + len(g.eqns)), weight=lambda s: s.weight)
    table["a"], table["b"], table["none"] = Stitched(g), Stitched(g, runs=True), Stitched(None)
    assert "a" not in table and table["b"].runs and table["none"].joint is None  # a None weighs one equation
    table["b"] = Stitched(g, runs=False)  # replaced: its weight counted once
    assert len(table) == 2 and table["b"].runs is False and table._held == 2 + len(g.eqns)
    table.clear()
    assert len(table) == 0 and table._held == 0
    const = torch.randn(64, 4, dtype=torch.float64)  # 2,048 bytes: four equations' weight
    big = ir.trace(lambda p, x: ((x @ const.T) * p).sum(), torch.ones(64, dtype=torch.float64),
                   torch.ones(2, 4, dtype=torch.float64))
    assert Stitched(big).weight == 1 + len(big.eqns) + 2048 // 512


def _attention(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        q = (x @ w).reshape(1, 2, 8, 4)
        x = torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(8, 8) + x
    return x.sum()


def _stitched_ops(workshop: Workshop, bounds: tuple[int, ...], cut: int | None = None) -> list[set[str]]:
    """The ops of each stage's programs (the workshop's graph cut at `cut`) costed on pieces between `bounds`."""
    made = len(STITCHED)
    stages = ir.split(workshop.graph(8), () if cut is None else (cut,))
    ads = [workshop.costing(8, stage, False, bounds) for stage in stages]
    assert len(STITCHED) >= made  # (stitched, not traced whole: a joint traced whole is no entry of it)
    return [{e.op for part in (ad.forward, ad.backward_input, ad.backward_weight) for e in part.graph.eqns}
            for ad in ads]


def test_a_joint_stitched_under_other_attention_kernels_or_bounds_is_not_found() -> None:
    """A Workshop that stitched under the default attention settings, asked for other stages on the same pieces
    under `sdpa_kernel(MATH)`, and a fresh Workshop then, stitch the math kernel, as a fresh process does (a
    review's case: the Workshop's own table was not keyed by the settings, and its flash joints went to the
    process's table under MATH's key). And the same stage cut into other pieces is stitched anew."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    w, x = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    JOINTS.clear(), STITCHED.clear()
    first = Workshop(_attention, w, (x,))
    n = len(first.graph(8).eqns)
    pieces = (0, 6, 11, n)  # a block of the model each: (matmul, reshape, attention, reshape, add)
    flash = lambda ops: any("flash" in op for op in ops)  # noqa: E731
    assert [flash(ops) for ops in _stitched_ops(first, pieces)] == [True] and len(STITCHED) == 1
    with sdpa_kernel(SDPBackend.MATH):
        assert [flash(ops) for ops in _stitched_ops(first, pieces, cut=6)] == [False, False]
        assert [flash(ops) for ops in _stitched_ops(Workshop(_attention, w, (x,)), pieces)] == [False]
    assert len(STITCHED) == 4  # the whole stage and its two halves under MATH: three more
    _stitched_ops(Workshop(_attention, w, (x,)), (0, 11, n))  # other pieces: stitched anew
    assert len(STITCHED) == 5
