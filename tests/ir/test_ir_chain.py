"""Any cut of a traced model, run as chained stage F/B/W programs, gives exactly torch.func.grad."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_cases import SCALE, ZOO, cut_sets, examples, trace_case, zoo

import ir
from ir.slicing import REDETACH
from engine.testing import chain_value_and_grad, max_relative_error, models

TOL = 1e-10  # float64


def _assert_chain_matches(case, graph, cuts, compiled=True):
    ref_grads, ref_loss = torch.func.grad_and_value(case.fn)(case.params, *case.batch)
    loss, grads = chain_value_and_grad(graph, case.params, *case.batch, cuts=cuts, compiled=compiled)
    err_loss, err_grads = max_relative_error(loss, ref_loss), max_relative_error(grads, ref_grads)
    assert err_loss <= TOL and err_grads <= TOL, \
        f"{case} cuts={cuts}: loss err {err_loss:.3g}, grad err {err_grads:.3g}"


@settings(max_examples=examples(100))
@given(models(max_layers=8), st.data())
def test_any_cuts_give_the_grads_of_torch_func(case, data):
    graph = trace_case(case)
    _assert_chain_matches(case, graph, data.draw(cut_sets(len(graph.eqns)), label="cuts"))


@settings(max_examples=examples(15))
@given(models(max_layers=5), st.data())
def test_any_cuts_interpreted(case, data):
    graph = trace_case(case)
    _assert_chain_matches(case, graph, data.draw(cut_sets(len(graph.eqns)), label="cuts"), compiled=False)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_single_cuts_all_along_the_zoo(name):
    """Every other cut position (the odd ones under FNPIPE_EXAMPLES > 1) of each fixed architecture."""
    case = zoo(name)
    graph = trace_case(case)
    for cut in range(1, len(graph.eqns), 1 if SCALE > 1 else 2):
        _assert_chain_matches(case, graph, [cut])


@settings(max_examples=examples(30))
@given(models(max_layers=8), st.data())
def test_stages_partition_the_graph_and_agree_on_boundaries(case, data):
    graph = trace_case(case)
    cuts = data.draw(cut_sets(len(graph.eqns)), label="cuts")
    stages = ir.split(graph, cuts)
    assert [s.index for s in stages] == list(range(len(cuts) + 1))
    assert [(s.start, s.stop) for s in stages] == list(zip([0, *cuts], [*cuts, len(graph.eqns)]))
    ops = [e.op for s in stages for e in s.graph.eqns if e.source != REDETACH]
    assert ops == [e.op for e in graph.eqns]
    assert stages[0].acts_in == () and stages[-1].acts_out == () and stages[-1].is_last
    for a, b in zip(stages, stages[1:]):
        assert a.acts_out == b.acts_in and not a.is_last
    values = list(graph.defined())
    for s in stages:
        ir.check(s.graph)
        assert s.graph.num_params == len(s.param_ids)
        ins = [graph.inputs[i] for i in (*s.param_ids, *s.batch_ids)] + [values[v] for v in s.acts_in]
        assert list(s.graph.inputs) == ins
        assert all(i < graph.num_params for i in s.param_ids) and all(i >= graph.num_params for i in s.batch_ids)


def test_tied_weights_sum_grads_across_stages():
    """The tied embedding is read by the first and the last stage; each stage's grad is partial."""
    case = zoo("transformer_lm_tied")
    graph = trace_case(case)
    cut = len(graph.eqns) // 2
    stages = ir.split(graph, [cut])
    embed = graph.input_names.index("embed")
    assert embed in stages[0].param_ids and embed in stages[1].param_ids
    _assert_chain_matches(case, graph, [cut])
