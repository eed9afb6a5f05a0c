"""ir.run_bytes: the bytes a compiled graph holds while it runs, checked by hand and against the CPU allocator."""
from __future__ import annotations

import pytest
import torch

import ir
from tests.cpu_allocator import allocator_peak

F32 = 4


def _graph(fn, *args):  # type: ignore[no-untyped-def]
    return ir.trace(fn, *args)


def test_values_die_at_last_use_and_outputs_stay() -> None:
    def fn(p, x):  # type: ignore[no-untyped-def]
        h = torch.relu(x @ p)   # [128, 256]
        return (h * 2).sum(), h  # h is returned: it stays

    g = _graph(fn, torch.randn(64, 256), torch.randn(128, 64))
    run = ir.run_bytes(g)
    big = 128 * 256 * F32
    # x@p (dies in relu), relu = h (kept), h*2 (dies in the sum, after the sum's scalar is made)
    assert run.peak == 2 * big + F32
    assert run.outputs == big + F32  # h and the scalar sum
    assert run.transient == big  # x@p or h*2, never both: h is an output and not counted


def test_a_view_keeps_its_base_alive() -> None:
    """`t()` of a product is a view: the product's storage lives until the view's last use."""
    def fn(p, x):  # type: ignore[no-untyped-def]
        a = x @ p            # [128, 256]
        b = a.t()            # view of a
        c = p + x[0, 0]      # [64, 256], while b still holds a (it reads x: ir.sink leaves it in place)
        return (c.sum() + b.sum())

    g = _graph(fn, torch.randn(64, 256), torch.randn(128, 64))
    assert ir.run_bytes(g).peak == (128 * 256 + 64 * 256) * F32 + F32  # a, c and c.sum(), at once


def test_an_accumulated_output_dies_after_its_add() -> None:
    def fn(p, x):  # type: ignore[no-untyped-def]
        return x @ p, (x @ p).sum()

    g = _graph(fn, torch.randn(64, 256), torch.randn(128, 64))
    kept, added = ir.run_bytes(g), ir.run_bytes(g, accumulate=(0,))
    assert kept.outputs == 128 * 256 * F32 + F32
    assert added.outputs == F32


@pytest.mark.parametrize("accumulate", [(), (0,)])
def test_the_peak_is_what_the_cpu_allocator_sees(accumulate: tuple[int, ...]) -> None:
    """The compiled program on real tensors: the allocator's peak is run_bytes' peak, to the byte (small
    scalars aside)."""
    def fn(p, x):  # type: ignore[no-untyped-def]
        h = torch.nn.functional.gelu(x @ p["w1"])
        y = torch.nn.functional.layer_norm(h @ p["w2"], (64,))
        return h.t() @ y, (y * y).mean()

    p = {"w1": torch.randn(64, 512), "w2": torch.randn(512, 64)}
    x = torch.randn(256, 64)
    g = _graph(fn, p, x)
    run = ir.compile_graph(g, accumulate)
    args = [p["w1"], p["w2"], x] + [torch.zeros(512, 64) for _ in accumulate]
    run(*args)  # warm-up outside the window
    predicted = ir.run_bytes(g, accumulate).peak
    measured = allocator_peak(lambda: run(*args))
    assert predicted == pytest.approx(measured, rel=0.01, abs=1024), (predicted, measured)


def test_outputs_say_which_storage_they_live_on() -> None:
    """`output_storage`: outputs on one storage the run makes name its first output and its bytes once;
    `output_inputs`: an output on an input's storage (the input, or a view of it) names that input;
    `output_views`: which outputs are views of another value (an input itself returned is not)."""
    def fn(p, x):  # type: ignore[no-untyped-def]
        a = x @ p                                   # [8, 16], made by the run
        return a.view(2, 4, 16), a.t(), x.view(-1), p, a + 1

    g = _graph(fn, torch.randn(4, 16), torch.randn(8, 4))
    made = 8 * 16 * F32
    assert ir.output_storage(g) == ((0, made), (0, made), None, None, (4, made))
    assert ir.output_inputs(g) == (None, None, 1, 0, None)
    assert ir.output_views(g) == (True, True, True, False, False)  # `a` itself is not an output here
    p, x = torch.randn(4, 16), torch.randn(8, 4)
    outs = fn(p, x)  # as eager torch keeps them
    assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()
    assert outs[2].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_a_cast_makes_a_new_tensor_and_a_same_dtype_to_is_its_input() -> None:
    """`x.to(float32)` of a bfloat16 value allocates a float32 copy (RMSNorm computing in float32, as Llama's does),
    `to` the dtype a value has already returns it: run_bytes against the CPU allocator, and `output_storage`."""
    def fn(p, x):  # type: ignore[no-untyped-def]
        h = (x @ p).to(torch.float32)                                   # a float32 copy of a bf16 product
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(torch.bfloat16).to(torch.bfloat16), h.to(torch.float32)

    p, x = torch.randn(64, 512, dtype=torch.bfloat16), torch.randn(256, 64, dtype=torch.bfloat16)
    g = _graph(fn, p, x)
    run = ir.compile_graph(g, ())
    run(p, x)  # warm-up outside the window
    predicted = ir.run_bytes(g).peak
    measured = allocator_peak(lambda: run(p, x))
    assert predicted == pytest.approx(measured, rel=0.01, abs=1024), (predicted, measured)
    made = 256 * 512
    assert ir.output_storage(g) == ((0, made * 2), (1, made * F32))  # the bf16 cast, and h itself
