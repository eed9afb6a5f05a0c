"""Mixed operand dtypes: the trace refuses exactly what PyTorch's CPU kernels refuse, naming the line."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import engine
import ir
from ir.dtype_rules import DtypeError

DTYPES = (torch.float32, torch.float64, torch.bfloat16)

# f(w, x): w plays the params (its dtype), x the batch
CASES = {
    "matmul": lambda w, x: x @ w(4, 3),
    "linear": lambda w, x: F.linear(x, w(3, 4), w(3)),
    "mv": lambda w, x: torch.mv(w(3, 4), x[0]),
    "addmm": lambda w, x: torch.addmm(w(3), x, w(4, 3)),
    "conv1d": lambda w, x: F.conv1d(x.unsqueeze(0), w(2, 2, 3)),
    "layer_norm": lambda w, x: F.layer_norm(x, (4,), w(4), w(4)),
    "batch_norm": lambda w, x: F.batch_norm(x, w(4), w(4), w(4), w(4), training=True),
    "group_norm": lambda w, x: F.group_norm(x.unsqueeze(-1), 2, w(4), w(4)),
    "cross_entropy_weight": lambda w, x: F.cross_entropy(x, torch.tensor([0, 1]), weight=w(4)),
    "index_add": lambda w, x: x.index_add(0, torch.tensor([1]), w(1, 4)),
    "index_copy": lambda w, x: x.index_copy(0, torch.tensor([1]), w(1, 4)),
    "index_put": lambda w, x: x.index_put((torch.tensor([1]),), w(1, 4)),
}


def _run(case: str, wd: torch.dtype, xd: torch.dtype, traced: bool) -> bool:
    made = iter(range(100))
    params = {f"w{i}": torch.rand(4 * 3 * 2 * 3).to(wd) for i in range(4)}

    def fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        def w(*shape: int) -> torch.Tensor:
            n = 1
            for s in shape:
                n *= s
            return p[f"w{next(made) % 4}"][:n].view(shape) + 0.5
        return CASES[case](w, x).float().sum()

    x = torch.randn(2, 4).to(xd)
    try:
        ir.trace(fn, params, x) if traced else fn(params, x)
        return True
    except DtypeError:
        assert traced
        return False
    except RuntimeError:
        assert not traced
        return False


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_trace_refuses_exactly_what_eager_refuses(case: str) -> None:
    for wd, xd in itertools.product(DTYPES, DTYPES):
        eager = _run(case, wd, xd, traced=False)
        assert _run(case, wd, xd, traced=True) == eager, (case, wd, xd, "eager ran" if eager else "eager refused")


def test_the_error_names_the_operands_the_line_and_the_fix() -> None:
    def loss_fn(params: dict, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ params["w1"])  # the line the error names
        return h.sum()

    with pytest.raises(ir.TraceError) as info:
        ir.trace(loss_fn, {"w1": torch.randn(8, 3)}, torch.randn(4, 8, dtype=torch.float64))
    msg = str(info.value)
    assert "matmul mixes dtypes: 'x' (float64), 'w1' (float32)" in msg
    assert "test_dtype_rules.py" in msg and 'h = torch.tanh(x @ params["w1"])' in msg
    assert "one dtype" in msg


def test_mixed_precision_norms_follow_the_device() -> None:
    """float32 norm params beside a bfloat16 input: batch norm takes them on the CPU and on CUDA, layer and
    group norm on the CPU only (an H100 refused them: `expected scalar type BFloat16 but found Float`)."""
    params = {"g": torch.ones(4), "b": torch.zeros(4), "m": torch.zeros(4), "v": torch.ones(4)}
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    layer = lambda p, x: F.layer_norm(x, (4,), p["g"], p["b"]).float().sum()  # noqa: E731
    group = lambda p, x: F.group_norm(x.unsqueeze(-1), 2, p["g"], p["b"]).float().sum()  # noqa: E731
    batch = lambda p, x: F.batch_norm(x, p["m"], p["v"], p["g"], p["b"]).float().sum()  # noqa: E731
    for fn in (layer, group, batch):
        ir.trace(fn, params, x)
    ir.trace(batch, params, x, device="cuda")
    for fn in (layer, group):
        with pytest.raises(DtypeError, match="norm mixes dtypes"):
            ir.trace(fn, params, x, device="cuda")


def test_what_the_kernels_take_despite_a_dtype_of_their_own() -> None:
    """A loss weight (binary cross-entropy), a class weight beside class probabilities, a 0-d value put
    through a mask on the CPU: eager runs them, so the trace does too."""
    x, w = torch.rand(2, 4, dtype=torch.float64), torch.rand(4)
    ir.trace(lambda p, x: F.binary_cross_entropy(x, x.detach() * 0.5, weight=p), w, x)
    ir.trace(lambda p, x: F.cross_entropy(x, torch.softmax(x, -1).detach(), weight=p), w, x)
    ir.trace(lambda p, x: x.index_put((x > 0.5,), p[0].reshape(())).sum(), w, x)


def test_parallelize_refuses_before_any_step() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    fn, variables = engine.functionalize(net, loss=F.cross_entropy)
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))  # a float32 batch for a float64 model
    with pytest.raises(ir.TraceError, match=r"linear mixes dtypes: 'x' \(float32\), 'params.0.weight' \(float64\)"):
        engine.parallelize(fn, variables, x, y, microbatches=2)
