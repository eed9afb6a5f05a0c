"""PyTorch's OpInfo database as pure loss functions, and the four checks fnpipe is measured by.

For each op of `torch.testing._internal.common_methods_invocations.op_db` that has float64 on CPU, up
to two of its sample inputs become one loss each: the floating tensors of the sample are the params
(a list), every other argument is closed over, and the loss is the sum of the op's outputs (after the
sample's `output_process_fn_grad`) times fixed random weights, times the mean of a one-row batch (a
batch leaf the harness can split). An op passes a check when all its samples do:

    torch traced   make_fx(fake, pre_dispatch) of the loss succeeds (PyTorch's own bar for tracing)
    traced         ir.trace succeeds
    evaluated      ir.evaluate equals the eager loss (NaN equal to NaN)
    torch grad     torch.func.grad succeeds, for an op with autograd
    grads          engine.testing.assert_parallel_equivalent at 2 stages, cut in the middle, passes

`REFUSED` is the list of ops fnpipe refuses by design (global RNG, random in-place, output shape
from data, BatchNorm writing running statistics, sparse layouts), each with its reason.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
import time
import types
import unittest
import warnings
from typing import Any, Callable, Iterator

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import ir
from engine.testing import assert_parallel_equivalent

SAMPLES = 2
RESULTS: list[OpResult] = []  # what a test run checked, for the coverage table at its end
CHECKS = ("torch_traced", "traced", "evaluated", "torch_grad", "grads")

# Design refusals: the op may stay refused, with a message naming the fix. Reasons by kind:
RNG = "draws from the global RNG (pure randomness needs the key as an input: ir.random)"
RNG_INPLACE = "random in-place op on the global RNG"
DATA_SHAPE = "output shape, or a value Python reads, depends on the data (make_fx on fake tensors fails too)"
BN_STATS = "writes BatchNorm running statistics in train mode"
SPARSE = "sparse layout"


def _ops_refused() -> dict[str, str]:
    # (nn.functional.dropout, dropout2d/3d and alpha_dropout pass: their samples are the identity, p = 0 or
    # eval mode; dropout with p > 0 in train mode is keyed (ir.keyed_dropout) or refused, tests/ir/test_ir_dropout.py)
    rng = ["bernoulli", "multinomial", "normal", "normal.number_mean",
           "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu", "rand_like", "randn_like",
           "randint_like", "randint", "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
           "randn", "svd_lowrank", "pca_lowrank", "nn.functional.multi_head_attention_forward"]
    rng_inplace = ["cauchy", "exponential", "geometric", "log_normal", "normal.in_place", "uniform"]
    shape = ["masked_select", "combinations", "nn.functional.ctc_loss", "linalg.lstsq", "linalg.lstsq.grad_oriented",
             "corrcoef", "cov", "narrow", "nn.functional.gaussian_nll_loss"]
    out = {n: RNG for n in rng}
    out.update({n: RNG_INPLACE for n in rng_inplace})
    out.update({n: DATA_SHAPE for n in shape})
    out.update({"_native_batch_norm_legit": BN_STATS, "_batch_norm_with_update": BN_STATS,
                "sparse.sampled_addmm": SPARSE, "sparse.mm.reduce": SPARSE})
    return out


REFUSED: dict[str, str] = _ops_refused()
# What fnpipe's message for each reason says (a refused op must fail with it, not by accident).
REFUSAL_TEXT: dict[str, tuple[str, ...]] = {
    RNG: ("global random state",), RNG_INPLACE: ("global random state",),
    DATA_SHAPE: ("depends on the data", "reads a tensor's value", "DynamicOutputShape", "DataDependent"),
    BN_STATS: ("mutates input",), SPARSE: ("Sparse", "sparse")}

# Not design refusals: where fnpipe still differs from eager torch.func.grad, with the cause. Kept honest
# like REFUSED (an op here that starts passing fails the test). None left (2026-11-23): index_reduce.prod and
# scatter_reduce.prod pass with the joint traced through torch.autograd.grad rather than functorch's vjp; sgn
# with the harness reading autograd's efficient zero tensors; index_fill through ir/static_fill.py.
GAPS: dict[str, str] = {}

# Ops whose output is uninitialised memory: their values are not comparable.
UNINITIALISED = {"empty_like", "empty", "new_empty", "new_empty_strided", "empty_strided"}


def op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _expecttest_stand_in() -> None:
    """torch's test utilities import `expecttest` for their TestCase base only; without the package
    (not a torch dependency) a stand-in with unittest's TestCase lets op_db import."""
    if importlib.util.find_spec("expecttest") is None and "expecttest" not in sys.modules:
        mod = types.ModuleType("expecttest")
        mod.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        mod.ACCEPT = False  # type: ignore[attr-defined]
        sys.modules["expecttest"] = mod


def float64_ops() -> list[Any]:
    """The OpInfos that run in float64 on CPU, in the database's order."""
    _expecttest_stand_in()
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float64 in op.supported_dtypes("cpu")]


# Ops that once failed for a cause of their own, run in every sampled run so the cause stays fixed.
REGRESSIONS = {"sgn", "index_reduce.prod", "scatter_reduce.prod", "masked.var", "masked.std", "masked.logaddexp",
               "index_fill", "fft.rfft", "linalg.svd", "linalg.inv", "dist", "linalg.vector_norm", "histogramdd", "index_put"}


def sample_ops(ops: list[Any], every: int) -> list[Any]:
    """Every `every`-th op plus every op on REFUSED, GAPS and REGRESSIONS: a deterministic slice."""
    return [op for i, op in enumerate(ops)
            if i % every == 0 or op_name(op) in REFUSED or op_name(op) in GAPS or op_name(op) in REGRESSIONS]


@attrs.frozen
class Case:
    """One sample of an op as `fn(params, x)`: params the sample's floating tensors, x a one-row batch."""

    fn: Callable[..., torch.Tensor]
    params: list[torch.Tensor]
    batch: tuple[torch.Tensor, ...]


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def _weights(out: Any, gen: torch.Generator) -> list[torch.Tensor | None]:
    return [torch.randn(_real(o).shape, generator=gen, dtype=torch.float64)
            if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex()) else None
            for o in pytree.tree_leaves(out)]


def _real(o: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(o) if o.is_complex() else o


def make_case(op: Any, sample: Any, name: str) -> Case:
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    is_param = [isinstance(x, torch.Tensor) and x.dtype.is_floating_point for x in leaves]
    params = [x.detach().clone() for x, p in zip(leaves, is_param) if p]
    post = sample.output_process_fn_grad

    def run(ps: list[torch.Tensor]) -> Any:
        it = iter(ps)
        args = [next(it) if p else x for x, p in zip(leaves, is_param)]
        inp, a, kw = pytree.tree_unflatten(args, spec)
        return post(op.op(inp, *a, **kw))

    with torch.no_grad():
        weights = _weights(run([p.clone() for p in params]), torch.Generator().manual_seed(_seed(name)))

    def loss(ps: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for o, w in zip(pytree.tree_leaves(run(ps)), weights):
            if w is not None:
                total = total + (_real(o) * w).sum()
        return total * x.mean()

    return Case(loss, params, (torch.ones(1, dtype=torch.float64),))


def cases(op: Any) -> list[Case]:
    samples = list(op.sample_inputs("cpu", torch.float64, requires_grad=False))[:SAMPLES]
    return [make_case(op, s, f"{op_name(op)}/{i}") for i, s in enumerate(samples)]


@attrs.define
class OpResult:
    """Which checks an op passed (None: not applicable), and the first failure's message per check."""

    name: str
    autograd: bool
    passed: dict[str, bool | None] = attrs.field(factory=dict)
    errors: dict[str, str] = attrs.field(factory=dict)
    seconds: float = 0.0


def _equal(a: Any, b: Any) -> bool:
    return torch.allclose(a, b, rtol=1e-10, atol=1e-12, equal_nan=True)


def _trace_torch(case: Case) -> None:
    flat, tree = pytree.tree_flatten((case.params, *case.batch))
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the op's closed-over arguments are real tensors
    fake = [mode.from_tensor(x) for x in flat]
    with mode:
        make_fx(lambda *xs: case.fn(*pytree.tree_unflatten(list(xs), tree)), tracing_mode="fake",
                pre_dispatch=True)(*fake)


def _grads(case: Case, graph: ir.Graph) -> None:
    n = len(graph.eqns)
    if n < 2:
        raise AssertionError(f"a graph of {n} equation(s) has no middle to cut")
    assert_parallel_equivalent(case.fn, case.params, *case.batch, stages=2, cuts=[n // 2], microbatches=1)


def _check(case: Case, result: OpResult) -> None:
    """Run the checks on one sample; a check already failed on an earlier sample is not rerun."""
    steps: list[tuple[str, Callable[[], Any]]] = [("torch_traced", lambda: _trace_torch(case))]
    graph: list[ir.Graph] = []
    steps.append(("traced", lambda: graph.append(ir.trace(case.fn, case.params, *case.batch))))
    steps.append(("evaluated", lambda: None if result.name in UNINITIALISED else _assert(_equal(ir.evaluate(graph[0], case.params, *case.batch),
                                                      case.fn(case.params, *case.batch)), "values differ")))
    if result.autograd:
        steps.append(("torch_grad", lambda: torch.func.grad(case.fn)(case.params, *case.batch)))
        steps.append(("grads", lambda: _grads(case, graph[0])))
    for check, step in steps:
        if check in ("evaluated", "grads") and not graph:
            result.passed[check] = False
            continue
        if result.passed.get(check) is False:
            continue
        try:
            step()
            result.passed.setdefault(check, True)
        except Exception as exc:  # noqa: BLE001 -- any failure is the measurement
            result.passed[check] = False
            result.errors[check] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def _assert(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def check_op(op: Any) -> OpResult:
    """All checks on up to SAMPLES samples of `op`."""
    result = OpResult(op_name(op), bool(op.supports_autograd))
    start = time.perf_counter()
    with _quiet():
        try:
            samples = cases(op)
        except Exception as exc:  # noqa: BLE001
            result.errors["samples"] = f"{type(exc).__name__}: {exc}"
            samples = []
        for case in samples:
            _check(case, result)
    if not samples:
        result.passed = {c: None for c in CHECKS}
    if not result.autograd:
        result.passed["torch_grad"] = result.passed["grads"] = None
    result.seconds = time.perf_counter() - start
    return result


def table(results: list[OpResult]) -> str:
    """The coverage table: ops passing each check, fnpipe against PyTorch."""
    count = lambda c: sum(r.passed.get(c) is True for r in results)  # noqa: E731
    grad_ops = sum(r.autograd and r.passed.get("torch_traced") is not None for r in results)
    refused = [r for r in results if r.name in REFUSED]
    known = [r for r in results if r.name in GAPS]
    lines = [f"ops: {len(results)} (float64, CPU, up to {SAMPLES} samples each; {grad_ops} with autograd)",
             "| | fnpipe | PyTorch |", "|---|---|---|",
             f"| traced (ir.trace / make_fx fake) | {count('traced')} | {count('torch_traced')} |",
             f"| evaluated equal | {count('evaluated')} | - |",
             f"| gradients equal across 2 stages | {count('grads')} | {count('torch_grad')} (torch.func.grad) |",
             f"design refusals in this run: {len(refused)}; known gaps (GAPS): {len(known)}"]
    return "\n".join(lines)


def gaps(results: list[OpResult]) -> list[tuple[str, str, str]]:
    """(op, check, error) where fnpipe fails a check whose PyTorch counterpart passes."""
    pairs = (("traced", "torch_traced"), ("evaluated", "traced"), ("grads", "torch_grad"))
    out = []
    for r in results:
        for ours, theirs in pairs:
            if r.passed.get(theirs) and r.passed.get(ours) is False:
                out.append((r.name, ours, r.errors.get(ours, "")))
                break
    return out
