"""engine.planning.pieces: each region's ratio spread over the kinds of block it holds, from timed pieces."""
from __future__ import annotations

import time
from typing import Any

import attrs
import pytest
import torch
from torch.utils import _pytree as pytree

import engine
import ir
from engine.planning.calibration import Calibration, calibrate_training, signature
from engine.planning.measured import MeasuredScale, Span
from engine.planning.pieces import likened, piece_scale, spread, timed_pieces
from engine.planning.regions import region_scale, with_regions
from engine.planning.tied import block_pieces
from examples import llama_model

CONFIG = attrs.evolve(llama_model.CONFIGS["tiny"], n_layers=4, d_model=64, ffn_dim=128)


@pytest.fixture(scope="module")
def llama() -> tuple[ir.Graph, list[torch.Tensor]]:
    torch.manual_seed(0)
    fn, variables = engine.functionalize(llama_model.build(CONFIG, torch.float32), loss=llama_model.lm_loss)
    tokens, targets = llama_model.example_batch(CONFIG, 4)
    g = ir.trace(fn, variables, tokens, targets)
    return g, pytree.tree_leaves((variables, tokens, targets))


def test_a_region_keeps_its_weighted_ratio_and_its_timed_kinds_share_it_as_their_pieces_ran() -> None:
    """Hand-worked: region 0:3 holds kinds 0, 1, 1 and ran F x1.5; kind 0's piece ran 2 x its ops, kind 1's 1 x,
    so equation 0 takes 1.5 * 2 / (4 / 3) = 2.25 and equations 1, 2 take 1.125 (their mean stays 1.5). Region 3:6
    holds one timed kind beside an untimed one: the timed kind's ratio cancels, nothing moves. Every pass alike."""
    region = MeasuredScale(6, [Span(0, 3, 1.5, 0.8, 1.2, 1.0), Span(3, 6, 0.9, 1.1, 0.7, 0.95)], "b")
    kinds = [0, 1, 1, 0, 2, 2]
    ratios = {0: (2.0, 3.0, 1.0, 2.0), 1: (1.0, 1.0, 1.0, 1.0)}
    out = spread(region, kinds, ratios, [1.0] * 6)
    f, b, w, bw = out.columns()
    assert f[:3] == pytest.approx([2.25, 1.125, 1.125]) and sum(f[:3]) / 3 == pytest.approx(1.5)
    assert b[:3] == pytest.approx([0.8 * 3 / (5 / 3), 0.8 / (5 / 3), 0.8 / (5 / 3)])
    assert w[:3] == pytest.approx([1.2] * 3)  # both kinds ran alike in W: nothing moves
    assert bw[:3] == pytest.approx([1.5, 0.75, 0.75])
    assert (f[3:], b[3:], w[3:], bw[3:]) == ([0.9] * 3, [1.1] * 3, [0.7] * 3, [0.95] * 3)
    assert out.batch == "b" and out.num_eqns == 6


def test_the_mean_is_weighted_by_forward_seconds_and_unweighed_equations_keep_their_ratio() -> None:
    region = MeasuredScale(4, [Span(0, 4, 1.0, 1.0, 1.0, 1.0)])
    out = spread(region, [0, 1, 1, 0], {0: (2.0,) * 4, 1: (1.0,) * 4}, [3.0, 1.0, 0.0, 0.0])
    f = out.columns()[0]
    mean = (3 * 2 + 1 * 1) / 4
    assert f == pytest.approx([2 / mean, 1 / mean, 1.0, 1.0])  # 0 s: views, nothing to weigh
    assert 3 * f[0] + f[1] == pytest.approx(4.0)


def test_the_llamas_attention_and_mlp_are_the_kinds_timed_one_piece_each(llama) -> None:  # type: ignore[no-untyped-def]
    g, _ = llama
    times = [float(ir.eqn_cost(e).flops + ir.eqn_cost(e).bytes) for e in g.eqns]
    chosen = timed_pieces(g, times)
    pieces = block_pieces(g)
    counts = {kind: sum(1 for k, _, _ in pieces if k == kind) for kind, _, _ in pieces}
    assert len(chosen) == 2 and all(counts[kind] >= CONFIG.n_layers - 1 for kind, _, _ in chosen)
    for kind, start, stop in chosen:  # the middle piece of its kind
        mine = [(s, e) for k, s, e in pieces if k == kind]
        assert (start, stop) == mine[len(mine) // 2]
    assert {stop - start for _, start, stop in chosen} == {47, 13}  # an attention piece and an MLP piece


def test_the_first_attention_which_also_makes_ropes_tables_is_costed_as_the_attentions(  # type: ignore[no-untyped-def]
        llama) -> None:
    g, _ = llama
    times = [float(ir.eqn_cost(e).flops + ir.eqn_cost(e).bytes) for e in g.eqns]
    chosen = timed_pieces(g, times)
    attention = next(kind for kind, start, stop in chosen if stop - start == 47)
    pieces = block_pieces(g)
    first = next((kind, start, stop) for kind, start, stop in pieces if stop - start == 53)  # RoPE's tables too
    assert first[0] != attention
    kinds = likened(g, chosen, times)
    assert set(kinds[first[1]:first[2]]) == {attention}
    for kind, start, stop in (*pieces[:1], *pieces[-3:]):  # the embedding, the head and its loss: their own
        assert set(kinds[start:stop]) == {kind}
    tail = pieces[-10]  # the last block's MLP without its norm (the splitter cuts it after the norm's rsqrt)
    assert [e.op for e in g.eqns[tail[1]:tail[2]]][-2:] == ["aten.linear.default", "aten.add.Tensor"]
    assert set(kinds[tail[1]:tail[2]]) == {next(kind for kind, start, stop in chosen if stop - start == 13)}


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


def test_a_model_of_one_kind_of_block_times_no_piece() -> None:
    """Six alike blocks are one kind (a kind's ratio cancels in its regions): nothing is worth timing."""
    fn, variables = engine.functionalize(torch.nn.Sequential(*[_Block() for _ in range(6)]),
                                         loss=lambda out, y: ((out - y) ** 2).mean())
    g = ir.trace(fn, variables, torch.randn(4, 16), torch.randn(4, 16))
    assert len({kind for kind, _, _ in block_pieces(g)}) < len(block_pieces(g))  # the blocks: one kind
    assert timed_pieces(g, [1.0] * len(g.eqns)) == []


def _slow_mlps(seconds: float) -> Any:
    """A 'compiler' whose programs holding an MLP (a SiLU) sleep `seconds` a run: the MLP pieces run slow."""
    return _slow("silu", seconds)


def test_slow_mlp_pieces_move_each_regions_time_onto_its_mlps(llama) -> None:  # type: ignore[no-untyped-def]
    """Programs holding an MLP sleep 20 ms a run: every region holds MLPs and sleeps alike, so the regions cannot
    tell attention from MLP; the timed pieces can. Within each region the MLP equations' forward ratio comes out
    well above the attention's, and each region's forward-seconds-weighted ratio is what the region measured."""
    g, inputs = llama
    dev = torch.device("cpu")
    cal = calibrate_training(g, "cpu", repeats=2, inputs=inputs)
    slow = _slow_mlps(0.02)
    region, cal = region_scale(g, dev, cal, inputs, compile_program=slow)
    assert region is not None
    out, grown = piece_scale(g, dev, region, cal, inputs, compile_program=slow)
    times = [grown.times.get(signature(e), 0.0) for e in g.eqns]
    kinds = {i: kind for kind, start, stop in block_pieces(g) for i in range(start, stop)}
    chosen = timed_pieces(g, times)
    attention, mlp = (next(kind for kind, start, stop in chosen if stop - start == n) for n in (47, 13))
    f = out.columns()[0]
    for span in region.spans:
        eqns = range(span.start, span.stop)
        weight = sum(times[i] for i in eqns)
        assert sum(times[i] * f[i] for i in eqns) / weight == pytest.approx(span.forward, rel=1e-9)
        att = [f[i] for i in eqns if kinds[i] == attention and times[i] > 0]
        mlps = [f[i] for i in eqns if kinds[i] == mlp and times[i] > 0]
        if att and mlps:
            assert min(mlps) > 3 * max(att), (span, min(mlps), max(att))


def test_with_regions_spreads_its_regions_and_an_older_format_is_measured_again(  # type: ignore[no-untyped-def]
        llama) -> None:
    g, inputs = llama
    dev = torch.device("cpu")
    table = with_regions(g, dev, calibrate_training(g, "cpu", repeats=2, inputs=inputs), inputs,
                         {"fx": _slow_mlps(0.02)})
    assert len(table.regions["fx"].spans) > 4  # more spans than the four regions: the kinds within each
    text = table.to_json().replace(', 7]', ', 6]')  # a table of the format before this one
    assert Calibration.from_json(text).regions == {}


def test_a_pass_some_kind_did_not_measure_is_left_as_the_region_has_it() -> None:
    """A kind whose B and W were not timed apart (None) cannot be set against one whose were: its B and W stay the
    region's, and the one kind measured there cancels, so B and W stay the region's; F and the whole backward,
    measured for both, are spread."""
    region = MeasuredScale(4, [Span(0, 4, 1.0, 0.8, 1.6, 1.0)])
    out = spread(region, [0, 1, 0, 1], {0: (2.0, None, None, 2.0), 1: (1.0, 0.5, 1.5, 1.0)}, [1.0] * 4)
    f, b, w, bw = out.columns()
    assert f == pytest.approx([4 / 3, 2 / 3] * 2) and bw == pytest.approx([4 / 3, 2 / 3] * 2)
    assert (b, w) == ([0.8] * 4, [1.6] * 4)


def test_a_resnets_repeated_fragments_are_not_timed() -> None:
    """A ResNet's pieces that repeat are single convolutions and BatchNorm fragments, each about 1 % of the
    forward: together far under COVER of it, so no piece is timed and its regions stand."""
    from engine.planning.pieces import COVER
    from examples import resnet_model

    fn, variables = engine.functionalize(resnet_model.WideResNet(50, 1, classes=10, base=8),
                                         loss=torch.nn.functional.cross_entropy)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    g = ir.trace(fn, variables, x, y)
    times = [float(ir.eqn_cost(e).flops + ir.eqn_cost(e).bytes) for e in g.eqns]
    pieces = block_pieces(g)
    counts: dict[int, int] = {}
    for kind, _, _ in pieces:
        counts[kind] = counts.get(kind, 0) + 1
    assert sum(1 for kind, _, _ in pieces if counts[kind] >= 2) > 100  # pieces do repeat: fragments of blocks
    assert timed_pieces(g, times) == []
    with pytest.MonkeyPatch.context() as patch:  # without the cover rule it would time two of them
        patch.setattr("engine.planning.pieces.COVER", 0.0)
        chosen = timed_pieces(g, times)
        assert len(chosen) >= 2 and sum(sum(times[s:e]) for k, s, e in pieces if k in {c[0] for c in chosen}) \
            < COVER * sum(times)


def test_a_hugging_face_llamas_attention_and_mlp_are_its_kinds_and_its_first_attention_is_likened() -> None:
    """A model we did not write (transformers' Llama, 4 layers, random init): its middle blocks' attention and MLP
    pieces are the kinds timed; its first attention, which also builds the rotary tables and the causal mask
    (93 equations against 45), and its last MLP (one op more) are costed as them; the embedding and the head keep
    their own kinds, and the head with its loss, 5 % of the forward here, is timed as a piece of its own."""
    from tests.models import zoo

    transformers = zoo._quiet_transformers()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**zoo._LM, "num_hidden_layers": 4})
    case = zoo.case("llama", transformers.LlamaForCausalLM(config), ("input_ids",), (zoo._ids(1), zoo._ids(1)),
                    loss=zoo.next_token_loss, output="logits")
    g = ir.trace(case.fn, case.params, *case.batch)
    times = [float(ir.eqn_cost(e).flops + ir.eqn_cost(e).bytes) for e in g.eqns]
    chosen = timed_pieces(g, times)
    assert sorted(stop - start for _, start, stop in chosen) == [6, 14, 45]
    head = chosen[-1]
    assert head[1:] == (len(g.eqns) - 6, len(g.eqns)) and sum(1 for k, _, _ in block_pieces(g) if k == head[0]) == 1
    assert [e.op for e in g.eqns[head[1]:head[2]]][::5] == ["aten.linear.default", "aten.cross_entropy_loss.default"]
    attention, mlp = (next(k for k, start, stop in chosen if stop - start == n) for n in (45, 14))
    kinds = likened(g, chosen, times)
    pieces = block_pieces(g)
    blocks = [(kinds[start], stop - start) for _, start, stop in pieces if kinds[start] in (attention, mlp)]
    assert blocks == [(attention, 93), (mlp, 14), (attention, 45), (mlp, 14), (attention, 45), (mlp, 14),
                      (attention, 45), (mlp, 15)]
    assert kinds[0] == pieces[0][0] and kinds[-1] == pieces[-1][0]


def test_a_piece_of_its_own_is_timed_only_above_single_and_when_no_timed_kind_costs_it(  # type: ignore[no-untyped-def]
        llama) -> None:
    """The tiny Llama's first attention (RoPE's tables too) and its last MLP are pieces of kinds of their own above
    SINGLE, but costed as the attention and MLP timed (`likened`): not timed again. Its head and loss, 2 % of the
    forward with 64 words, is under SINGLE; at 1 % it is timed."""
    from engine.planning import pieces as pieces_module

    g, _ = llama
    times = [float(ir.eqn_cost(e).flops + ir.eqn_cost(e).bytes) for e in g.eqns]
    total = sum(times)
    pieces = block_pieces(g)
    counts = {kind: sum(1 for k, _, _ in pieces if k == kind) for kind, _, _ in pieces}
    singles = [(k, s, e) for k, s, e in pieces if counts[k] == 1 and sum(times[s:e]) >= pieces_module.SINGLE * total]
    assert {e - s for _, s, e in singles} == {53, 9}  # the first attention and the last MLP
    chosen = timed_pieces(g, times)
    assert sorted(e - s for _, s, e in chosen) == [13, 47]
    head = next(p for p in pieces if g.eqns[p[1]].op == "aten.linear.default" and p[2] - p[1] == 1
                and counts[p[0]] == 1)
    assert 0.01 * total < sum(times[head[1]:head[2]]) < pieces_module.SINGLE * total
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pieces_module, "SINGLE", 0.01)
        assert sorted(timed_pieces(g, times)) == sorted([*chosen, head])


def _slow(op: str, seconds: float) -> Any:
    """A 'compiler' whose programs holding `op` sleep `seconds` a run."""
    def compile_program(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        fn = ir.compile_graph(graph, acc)
        if not any(op in e.op for e in graph.eqns):
            return fn

        def run(*args: Any) -> Any:
            time.sleep(seconds)
            return fn(*args)
        return run
    return compile_program


def test_a_slow_head_takes_its_regions_time_from_the_block_beside_it() -> None:
    """A Llama of 1,024 words, whose head and loss hold SINGLE of the forward: it is timed as a piece, and with
    programs holding the loss (its nll_loss) sleeping 20 ms a run, the head's forward ratio in its region comes
    out well above the block's there, while the region's forward-seconds-weighted ratio stays what the region
    measured."""
    torch.manual_seed(0)
    config = attrs.evolve(CONFIG, vocab_size=1024)
    fn, variables = engine.functionalize(llama_model.build(config, torch.float32), loss=llama_model.lm_loss)
    tokens, targets = llama_model.example_batch(config, 4)
    g = ir.trace(fn, variables, tokens, targets)
    inputs = pytree.tree_leaves((variables, tokens, targets))
    dev = torch.device("cpu")
    cal = calibrate_training(g, "cpu", repeats=2, inputs=inputs)
    slow = _slow("nll_loss", 0.02)
    region, cal = region_scale(g, dev, cal, inputs, compile_program=slow, regions=2)  # the head's region: a
    assert region is not None and len(region.spans) == 2  # half of the model (four, and it may hold the head alone)
    out, grown = piece_scale(g, dev, region, cal, inputs, compile_program=slow)
    times = [grown.times.get(signature(e), 0.0) for e in g.eqns]
    chosen = timed_pieces(g, times)
    _, start, stop = head = chosen[-1]  # (the first attention may be timed too: RoPE's tables, timed on a CPU)
    assert g.eqns[start].op == "aten.linear.default" and stop == len(g.eqns), chosen
    span = next(s for s in region.spans if s.start <= start < s.stop)
    eqns = range(span.start, span.stop)
    f = out.columns()[0]
    weight = sum(times[i] for i in eqns)
    assert sum(times[i] * f[i] for i in eqns) / weight == pytest.approx(span.forward, rel=1e-9)
    timed_kinds = {kind for kind, _, _ in chosen}
    kinds = likened(g, chosen, times)
    blocks = [f[i] for i in eqns if kinds[i] in timed_kinds - {head[0]} and times[i] > 0]
    heads = [f[i] for i in range(start, stop) if times[i] > 0]
    assert blocks and heads and min(heads) > 3 * max(blocks), (heads, blocks)


def test_a_kind_that_did_not_measure_a_pass_keeps_the_regions_ratio_and_the_others_are_spread() -> None:
    """Three kinds in one region; kind 0 (an embedding, say: no B program) has no B ratio. B is spread over kinds 1
    and 2 alone (their time-weighted B kept), kind 0 keeps the region's B; F over all three."""
    region = MeasuredScale(3, [Span(0, 3, 1.0, 0.9, 1.2, 1.0)])
    out = spread(region, [0, 1, 2], {0: (2.0, None, 1.0, 2.0), 1: (1.0, 1.0, 1.0, 1.0), 2: (1.0, 3.0, 1.0, 1.0)},
                 [1.0, 1.0, 1.0])
    f, b, w, _ = out.columns()
    assert b == pytest.approx([0.9, 0.9 * 2 / 4, 0.9 * 6 / 4]) and (b[1] + b[2]) / 2 == pytest.approx(0.9)
    assert f == pytest.approx([1.5, 0.75, 0.75]) and w == pytest.approx([1.2] * 3)


def test_a_head_alone_in_its_region_is_not_timed() -> None:
    """The 1,024-word Llama's head and loss qualify as a piece of its own; in a region that also holds blocks it is
    kept, in a region of its own (its ratio would cancel there) it is dropped, and the blocks' kinds stay."""
    from engine.planning.pieces import accompanied

    config = attrs.evolve(CONFIG, vocab_size=1024)
    fn, variables = engine.functionalize(llama_model.build(config, torch.float32), loss=llama_model.lm_loss)
    g = ir.trace(fn, variables, *llama_model.example_batch(config, 4))
    times = [float(ir.eqn_cost(e).flops + ir.eqn_cost(e).bytes) for e in g.eqns]
    chosen = timed_pieces(g, times)
    head = chosen[-1]
    assert head[2] == len(g.eqns) and len(chosen) == 3, chosen
    n = len(g.eqns)
    together = MeasuredScale(n, [Span(0, n // 2, 1, 1, 1, 1), Span(n // 2, n, 1, 1, 1, 1)])
    alone = MeasuredScale(n, [Span(0, head[1], 1, 1, 1, 1), Span(head[1], n, 1, 1, 1, 1)])
    assert accompanied(g, chosen, together, times) == chosen
    assert accompanied(g, chosen, alone, times) == chosen[:-1]
