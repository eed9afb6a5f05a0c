"""CUDA graphs of the compute instructions (`engine/execution/graphs.py`), their bookkeeping checked on CPU.

A CUDA graph keeps its kernels' addresses: a replay reads its inputs where the capture found them and writes its
outputs where the capture put them. `Recorded` does the same on CPU: it keeps the capture's arguments and outputs
and a replay runs the program on those same tensors and writes into those same outputs. So every step after the
capture checks what the runtime must do for a real graph: copy each new input (a batch, new parameters, a
received tensor) into the place the capture held, hand later instructions the outputs at their captured places,
add grads into accumulators that outlive the step and hand out copies. The GPU run of the same machinery:
`FNPIPE_CUDA_GRAPHS=1 FNPIPE_EQ_STEPS=3 mpirun -n 2 python tests/mpi/equivalence.py`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch
from torch.utils import _pytree as pytree

import ir
from engine.errors import PlanError
from engine.execution import graphs as graphs_mod
from engine.execution.footprint import footprint
from engine.execution.graphs import Graphs, _Tensor
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.plan import Plan, StagePlan
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

COMPUTES = ("forward", "backward", "backward_input", "backward_weight")
TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, head_dim=8)


class _Replay:
    """A recorded program: its arguments and outputs as the capture had them."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], outs: Any) -> None:
        self.fn, self.args, self.outs, self.replays = fn, list(args), outs, 0

    def replay(self) -> None:
        self.replays += 1
        new = self.fn(*self.args)
        for kept, made in zip(_flat(self.outs), _flat(new)):
            if kept is not None and kept is not made:
                kept.copy_(made)


def _flat(outs: Any) -> list[Any]:
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


class Recorded(Graphs):
    """Graphs that record on CPU: the capture runs the program once and undoes what it added in place (a CUDA
    capture runs nothing), so the replay right after it is the step's one run."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.recorded: list[_Replay] = []

    def record(self, fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, Any]:
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        outs = fn(*args)
        for a, b in zip(args, before):
            if isinstance(a, torch.Tensor):
                a.copy_(b)
        graph = _Replay(fn, args, outs)
        self.recorded.append(graph)
        return graph, outs


def _reference(params: Any, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    loss, grads = torch.func.grad_and_value(make_loss_fn(TINY))(params, *batch)[::-1]
    return loss, grads


def _check(result: Any, params: Any, batch: Sequence[torch.Tensor]) -> None:
    loss, ref = _reference(params, batch)
    assert torch.allclose(result.loss, loss, rtol=1e-12, atol=0)
    for got, want in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(ref)):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-14), (got - want).abs().max()


def _graphed(schedule: str, stages: int, ranks: int, dp: int = 1, hook: Any = None,
             model: tuple[Callable[..., Any], Any, Any] | None = None,
             cuts: tuple[int, ...] | None = None) -> tuple[Any, Any, list[Any], list[Recorded]]:
    """(params, batch, each rank's Step, each rank's Recorded graphs): TINY (or `model`: its loss function,
    params and batch) cut evenly into `stages` (or at `cuts`)."""
    fn, params, batch = model or (make_loss_fn(TINY), init_params(TINY, torch.float64), example_batch(TINY, 8))
    n = len(ir.trace(fn, params, *[b[:2] for b in batch]).eqns)
    options = (("stages_per_rank", stages // ranks),) if schedule == "interleaved-1f1b" else ()
    plan = Plan(schedule, stages, ranks, dp, 4, cuts or tuple(n * k // stages for k in range(1, stages)),
                stages=tuple(StagePlan(k, 0, 0, 0) for k in range(stages)), schedule_options=options)
    steps = list(build_steps(fn, params, batch, plan, hook=hook))
    fakes = [Recorded() for _ in steps]
    for s, g in zip(steps, fakes):
        s.executor.graphs = g
    return params, batch, steps, fakes


@pytest.mark.parametrize("schedule,stages,ranks,dp", [("1f1b", 2, 2, 1), ("zbv", 4, 2, 1), ("zb-h1", 3, 3, 1),
                                                      ("interleaved-1f1b", 4, 2, 1), ("1f1b", 2, 2, 2)])
def test_replayed_steps_give_the_grads_of_torch_func(schedule: str, stages: int, ranks: int, dp: int) -> None:
    """Four steps: eager, capture, replay with a new batch, replay with new parameter tensors; each equals
    torch.func.grad, and every compute instruction after the first step ran as a replay. With dp 2 the grads are
    summed over replicas after the accumulators (the sum hands back views of the flat buffer, not them)."""
    params, batch, steps, fakes = _graphed(schedule, stages, ranks, dp)
    batches = [batch, batch, example_batch(TINY, 8, seed=7), example_batch(TINY, 8, seed=9)]
    given = []  # every step's params and batch, with copies of their values then
    for k, b in enumerate(batches):
        if k == 3:
            params = pytree.tree_map(lambda p: p * 1.01, params)  # new tensors: copied into the captured ones
        given.append((pytree.tree_leaves((params, b)), [t.clone() for t in pytree.tree_leaves((params, b))]))
        _check(run_steps(steps, params, b), params, b)
        assert all(g.state == ("warm" if k == 0 else "replay") for g in fakes), [g.state for g in fakes]
    for tensors, values in given:  # the user's tensors are read, never written
        assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    computes = [sum(i.kind in ("forward", "backward", "backward_input", "backward_weight") for i in s.program.instrs)
                for s in steps]
    for g, c in zip(fakes, computes):
        assert len(g.recorded) == c  # one graph per compute instruction
        assert all(r.replays == 3 for r in g.recorded)  # the capture step's run and two replays


def test_the_step_hands_out_copies_of_its_accumulators() -> None:
    """A later step must not change the grads an earlier one returned (the accumulators are the graphs')."""
    params, batch, steps, _ = _graphed("1f1b", 2, 2)
    kept: list[list[torch.Tensor]] = []
    for k in range(3):
        result = run_steps(steps, params, batch if k < 2 else example_batch(TINY, 8, seed=5))
        kept.append([g.clone() for g in pytree.tree_leaves(result.grads)])
        if k == 1:
            held = pytree.tree_leaves(result.grads)
    for a, b in zip(held, kept[1]):  # step 3 ran with another batch; step 2's grads are as they were
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(kept[1], kept[2]))


def test_an_input_of_another_shape_at_replay_runs_eagerly_and_turns_graphs_off() -> None:
    g = Recorded()
    g.begin_step()
    g.end_step(True)
    g.begin_step()
    x = torch.ones(3)
    g.run(1, (0, "forward", ()), lambda t: t + 1, [x])
    g.end_step(True)
    g.begin_step()
    out = g.run(1, (0, "forward", ()), lambda t: t + 1, [torch.ones(4)])
    assert torch.equal(out, torch.full((4,), 2.0)) and g.state == "off"


def test_a_place_rebuilds_the_same_view() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:3, 2:5]
    again = _Tensor.of(view).rebuild(torch.device("cpu"))
    assert again.data_ptr() == view.data_ptr() and torch.equal(again, view)
    base[2, 3] = -1.0
    assert again[1, 1] == -1.0


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(graphs_mod.SWITCH, "1")
    assert not graphs_mod.enabled(torch.device("cpu"))  # CUDA only
    monkeypatch.setenv(graphs_mod.SWITCH, "sometimes")
    with pytest.raises(PlanError, match="FNPIPE_CUDA_GRAPHS"):
        graphs_mod.enabled(torch.device("cpu"))


def test_parameters_changed_in_place_are_copied_again() -> None:
    """An optimizer that updates the parameters in place (torch.optim) hands the same tensors with new values:
    the replay must read the new values (each tensor's version counter says they changed)."""
    params, batch, steps, _ = _graphed("1f1b", 2, 2)
    for k in range(4):
        if k >= 2:
            with torch.no_grad():
                for p in pytree.tree_leaves(params):
                    p.mul_(1.01)
        _check(run_steps(steps, params, batch), params, batch)
    assert all(s.executor.graphs.state == "replay" for s in steps)


def test_engine_init_refuses_a_bad_switch_before_any_communication(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine

    monkeypatch.setenv(graphs_mod.SWITCH, "maybe")
    with pytest.raises(PlanError, match="FNPIPE_CUDA_GRAPHS='maybe'"):
        engine.init()


def _storages(tensors: Any) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@pytest.mark.parametrize("schedule,stages,ranks", [("1f1b", 2, 2), ("zbv", 4, 2), ("interleaved-1f1b", 4, 2)])
def test_the_graphed_footprint_is_what_the_graphs_hold(schedule: str, stages: int, ranks: int) -> None:
    """`step.memory()` with graphs (`footprint._Graphed`), against what the capture step holds on CPU: `kept`
    is every storage a captured graph holds as an input (clones of the user's tensors, received values) and the
    accumulators; `pool` is the most the computes' values (and the sent ones, kept to the step's end) held at
    once, with each compute's own temporaries taken as 0 bytes here (`measured`)."""
    _check_graphed_footprint(schedule, stages, ranks)


@pytest.mark.parametrize("schedule,stages,ranks", [("1f1b", 2, 2), ("zbv", 4, 2)])
def test_the_graphed_pool_holds_views_of_one_value_once(schedule: str, stages: int, ranks: int) -> None:
    """Two Linears reading one 3-D input (the Llama's wq / wk / wv) each save their own `view(x, [b*t, d])`:
    outputs of F on one storage, which the pool holds once (the replay counted each view: session 28)."""
    torch.manual_seed(0)
    d, h = 16, 24
    params = {"layers": [{"a": torch.randn(h, d, dtype=torch.float64), "b": torch.randn(h, d, dtype=torch.float64),
                          "o": torch.randn(d, h, dtype=torch.float64) / h} for _ in range(4)],
              "head": torch.randn(10, d, dtype=torch.float64)}

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        for layer in p["layers"]:
            z = torch.nn.functional.layer_norm(x, (d,))
            x = x + torch.nn.functional.linear(torch.nn.functional.linear(z, layer["a"]).relu()
                                               * torch.nn.functional.linear(z, layer["b"]), layer["o"])
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, p["head"]).flatten(0, 1), y.flatten())

    batch = (torch.randn(8, 6, d, dtype=torch.float64), torch.randint(0, 10, (8, 6)))
    shared = _check_graphed_footprint(schedule, stages, ranks, model=(loss_fn, params, batch))
    assert shared > 0  # F's outputs did share storages


@pytest.mark.parametrize("linears", [1, 2])
def test_a_view_of_a_handed_over_value_copied_inside_the_graph_is_its_own_storage(linears: int) -> None:
    """zbv's turn of the V: stage 2 starts with a transpose, so the cotangent it hands stage 1 on rank 1 is not
    contiguous; stage 1's B copies it inside its graph and hands W a `view` of that copy (one per Linear that made
    stage 1's output): one storage of its own in the pool, not the handed-over value's (a review's cases)."""
    torch.manual_seed(0)
    d = 8
    params = {"w0": torch.randn(d, d, dtype=torch.float64) / 3, "w1": torch.randn(d, 4 * d, dtype=torch.float64) / 3,
              "v1": torch.randn(d, 4 * d, dtype=torch.float64) / 3, "c1": torch.randn(4 * d, dtype=torch.float64),
              "w2": torch.randn(d, d, dtype=torch.float64) / 3, "head": torch.randn(d, 3, dtype=torch.float64)}

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        a = torch.tanh(x @ p["w0"])                         # stage 0
        b = a @ p["w1"] + p["c1"]                           # stage 1: ends with one or two 3-D Linears
        b = b + torch.sin(a) @ p["v1"] if linears == 2 else b
        b = torch.tanh(b.transpose(1, 2)) @ p["w2"]         # stage 2: starts with a transpose
        return ((torch.tanh(b) @ p["head"]) - y).pow(2).mean()

    batch = (torch.randn(8, d, d, dtype=torch.float64), torch.randn(8, 4 * d, 3, dtype=torch.float64))
    ops = [e.op for e in ir.trace(loss_fn, params, *[t[:2] for t in batch]).eqns]
    turn = ops.index("aten.transpose.int")
    _check_graphed_footprint("zbv", 4, 2, model=(loss_fn, params, batch), cuts=(2, turn, turn + 3))


def _check_graphed_footprint(schedule: str, stages: int, ranks: int,
                             model: tuple[Callable[..., Any], Any, Any] | None = None,
                             cuts: tuple[int, ...] | None = None) -> int:
    """The checks of `test_the_graphed_footprint_is_what_the_graphs_hold`, on TINY or `model`; returns how many
    of the computes' live values shared a storage with another at some point."""
    seen: dict[int, list[int]] = {r: [] for r in range(ranks)}
    shared = 0
    made: dict[int, set[str]] = {}
    made_ids: dict[int, set[int]] = {}  # ids of the computes' values seen so far (a sent one outlives its ref)

    def pooled(ex: Any) -> int:
        outs = made.setdefault(ex.program.rank, {r for i in ex.program.instrs if i.kind in COMPUTES
                                                 for r in i.writes if r[0] == "b" and r not in i.reads})
        ids = made_ids.setdefault(ex.program.rank, set())
        live = {id(t): t for r, t in ex.bufs.items() if r in outs}
        live.update((id(t), t) for _, t in ex.sends if id(t) in ids)
        ids.update(live)
        nonlocal shared
        kept = {slot.held.untyped_storage().data_ptr() for c in ex.graphs.captured.values() for slot in c.inputs
                if slot is not None and slot.held is not None}  # a view of a kept input is not in the pool
        on = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live.values()}
        shared = max(shared, len(live) - len(on))
        return sum(n for ptr, n in on.items() if ptr not in kept)  # each storage once: views of one value share it

    def hook(ex: Any, ins: Any) -> None:
        if ex.graphs.capturing:
            seen[ex.program.rank].append(pooled(ex))

    params, batch, steps, fakes = _graphed(schedule, stages, ranks, hook=hook, model=model, cuts=cuts)
    for _ in range(2):  # eager, capture
        run_steps(steps, params, batch)
    for rank, (step, g) in enumerate(zip(steps, fakes)):
        fp = footprint(step.program, step.infos, step.graph, microbatches=4, measured=lambda key: 0, graphs=True)
        assert fp.kept == _kept(step, g), (rank, fp.kept, _kept(step, g))
        assert fp.pool == max(seen[rank]) > 0, (rank, fp.pool, max(seen[rank]))
    return shared


def _kept(step: Any, g: Recorded) -> int:
    """The bytes of every storage a captured graph holds as an input, and of the accumulators."""
    held = [slot.held for c in g.captured.values() for slot in c.inputs if slot is not None and slot.held is not None]
    return sum(_storages([*held, *step.executor.own_grads.values()]).values())


NARROW = 16


def _narrowing(p: Any, x: torch.Tensor) -> torch.Tensor:
    h = x
    for w in p:
        h = torch.tanh(h @ w)[:, :NARROW]  # each stage hands on a view that is not contiguous
    return (h * h).mean()


def test_a_non_contiguous_hand_over_is_copied_inside_the_graph() -> None:
    """zbv's turn of the V hands a value to the same rank's next stage as it is; here a column slice, which the
    next program (traced on a contiguous input) needs copied. With graphs the copy is made inside the graph, a
    temporary of its pool, so the graphs hold nothing more for good than `step.memory()` says, and the grads
    are torch.func's."""
    torch.manual_seed(0)
    params = [torch.randn(NARROW, 2 * NARROW, dtype=torch.float64) / 4 for _ in range(4)]
    x = torch.randn(8, NARROW, dtype=torch.float64)
    g = ir.trace(_narrowing, params, x[:2])
    cuts = tuple(i + 1 for i, e in enumerate(g.eqns) if "slice" in e.op)[:-1]
    plan = Plan("zbv", 4, 2, 1, 4, cuts, stages=tuple(StagePlan(k, 0, 0, 0) for k in range(4)))
    steps = list(build_steps(_narrowing, params, (x,), plan))
    fakes = [Recorded() for _ in steps]
    for s, f in zip(steps, fakes):
        s.executor.graphs = f
    want_loss, want = torch.func.grad_and_value(_narrowing)(params, x)[::-1]
    for _ in range(3):  # eager, capture, replay
        result = run_steps(steps, params, (x,))
        assert torch.allclose(result.loss, want_loss, rtol=1e-12, atol=0)
        assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(result.grads, want))
    assert all(f.state == "replay" for f in fakes)
    for step, f in zip(steps, fakes):
        fp = footprint(step.program, step.infos, step.graph, microbatches=4, measured=lambda key: 0, graphs=True)
        assert fp.kept == _kept(step, f)


def test_a_graphed_footprint_holds_more_than_the_eager_one() -> None:
    """The same program with graphs: clones of the parameters, the accumulators all step, the pool kept."""
    _, _, steps, _ = _graphed("1f1b", 2, 2)
    for step in steps:
        eager = footprint(step.program, step.infos, step.graph, microbatches=4)
        graphed = footprint(step.program, step.infos, step.graph, microbatches=4, graphs=True)
        assert eager.pool == eager.kept == 0 and graphed.pool > 0
        assert graphed.static == eager.static and graphed.peak > eager.peak
        assert "graphs' pool" in str(graphed) and "graphs' pool" not in str(eager)
