"""engine.optim: functional SGD/AdamW equal torch.optim (foreach and fused) and never write to their inputs;
accumulation; global-norm clipping over ranks."""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from engine import checkpoint, optim
from engine.errors import EngineError
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.plan import Plan, StagePlan
from engine.testing import max_relative_error
from engine.training import optim_kernels
from tests.mpi import models


def on_ranks(steps: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """`fn(step)` on every in-process rank at once (their collectives meet in the hub)."""
    hub = steps[0].transport.hub
    with hub.cv:
        hub.alive, hub.failure = set(range(len(steps))), None
    out: list[Any] = [None] * len(steps)
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            out[r] = fn(steps[r])
            hub.exit(r)
        except BaseException as exc:  # noqa: BLE001 -- re-raised below
            errors.append(exc)
            hub.exit(r, repr(exc))

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(steps))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    return out


def tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if x is not None]


def tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"w": r(4, 3), "layers": [{"b": r(3)}, {"b": r(3), "skip": None}], "s": r(())}


def torch_steps(make, params: dict, grads: Sequence[dict]) -> list[torch.Tensor]:
    leaves = [x.clone() for x in tensors(params)]
    opt = make(leaves)
    for g in grads:
        for x, gx in zip(leaves, tensors(g)):
            x.grad = gx.clone()
        opt.step()
    return leaves


SGD_CASES = [dict(lr=0.1), dict(lr=0.05, momentum=0.9, weight_decay=0.01),
             dict(lr=0.05, momentum=0.8, dampening=0.3), dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1)]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(kw))
def test_sgd_equals_torch_over_steps(kw):
    params, grads = tree(0), [tree(s) for s in (1, 2, 3, 4)]
    ours, state = params, None
    for g in grads:
        ours, state = optim.sgd(ours, g, state, **kw)
    ref = torch_steps(lambda ps: torch.optim.SGD(ps, **kw), params, grads)
    assert ours["layers"][1]["skip"] is None and state["momentum"]["layers"][1]["skip"] is None
    assert max_relative_error(tensors(ours), ref) <= 1e-12


def test_adamw_equals_torch_and_state_is_serialisable(tmp_path):
    params, grads = tree(0), [tree(s) for s in (5, 6, 7, 8, 9)]
    kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    ours, state = params, None
    for g in grads:
        ours, state = optim.adamw(ours, g, state, **kw)
    ref = torch_steps(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), params, grads)
    assert max_relative_error(tensors(ours), ref) <= 1e-12
    assert state["step"] == 5 and json.dumps(state["step"])
    torch.save(state, tmp_path / "s.pt")
    again = torch.load(tmp_path / "s.pt", weights_only=True)
    assert max_relative_error(tensors(again["exp_avg_sq"]), tensors(state["exp_avg_sq"])) == 0


def test_torch_optim_on_local_leaves_equals_functional():
    params, grads = tree(0), [tree(s) for s in (1, 2)]
    sharded = pytree.tree_map(lambda x: None if x is None else x.clone(), params)
    local = optim.local_leaves(sharded)
    opt = torch.optim.AdamW(local, lr=0.01, foreach=False)
    ours, state = params, None
    for g in grads:
        optim.set_grads(sharded, g)
        opt.step()
        ours, state = optim.adamw(ours, g, state, lr=0.01)
    assert max_relative_error(tensors(sharded), tensors(ours)) <= 1e-12


def test_accumulated_half_batches_divided_by_k_equal_the_full_batch_grad():
    params, (x, y) = models.init_params(layers=2), models.batch(size=8)
    full = torch.func.grad(models.loss_fn)(params, x, y)
    acc = None
    for part in range(2):
        acc = optim.accumulate(acc, torch.func.grad(models.loss_fn)(params, x[part::2], y[part::2]))
    assert max_relative_error(optim.scale(acc, 1 / 2), full) <= 1e-12
    with pytest.raises(ValueError, match="does not match params tree"):
        optim.accumulate(acc, {"w": 1})


@pytest.mark.parametrize("max_norm", [1e-2, 1e3])
def test_clip_grad_norm_single_process_equals_torch(max_norm):
    grads = tree(3)
    ours, norm = optim.clip_grad_norm(grads, max_norm)
    ref = _with_grads(tensors(grads))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm).item()
    assert abs(norm.item() - ref_norm) <= 1e-12 * ref_norm
    assert max_relative_error(tensors(ours), [p.grad for p in ref]) <= 1e-12


def _with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


def test_clip_grad_norm_counts_each_leaf_once_over_stages_replicas_and_tied_copies():
    params, batch = models.init_params(layers=4), models.batch(size=8)
    grads_ref = torch.func.grad(models.loss_fn)(params, *batch)
    ref = _with_grads(tensors(grads_ref))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.1).item()
    plan = Plan("1f1b", 2, 2, 2, 2, (14,), (StagePlan(0, 0, 0, 0), StagePlan(1, 0, 0, 1)))  # 2 stages x dp 2
    steps = build_steps(models.loss_fn, params, batch, plan)
    res = run_steps(steps, params, batch)
    assert [0 in s.local_params for s in steps] == [True] * 4  # the tied embedding: 2 stages x 2 replicas
    clipped = on_ranks(steps, lambda s: optim.clip_grad_norm(res.per_rank[s.world.rank][1], 0.1, step=s))
    for rank, (g, norm) in enumerate(clipped):
        assert abs(norm.item() - ref_norm) <= 1e-12 * ref_norm, rank
        for mine, want in zip(pytree.tree_leaves(g), ref):
            assert mine is None or (mine - want.grad).norm() <= 1e-12 * want.grad.norm()


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_clip_grad_norm_under_mpirun_equals_one_process(ranks: int) -> None:
    """The global norm over stages and dp replicas (each leaf counted once) equals torch's on one process."""
    import re
    import sys as _sys

    from tests.mpi.jobs import BIN, job_env, launch

    out = launch([str(BIN / "mpirun"), "-n", str(ranks), "--oversubscribe", "--bind-to", "none", _sys.executable,
                  "tests/mpi/clip_grad_norm.py"], timeout=300, env=job_env())
    configs = 1 if ranks == 2 else 2
    assert "FAIL" not in out, out
    assert len(re.findall(r"^OK rank \d+ ", out, flags=re.M)) == ranks * configs, out


# ---- property tests: engine.optim against torch.optim on random trees ----

FUSABLE = (torch.float32, torch.float64)  # what fused=None steps fused; the rest goes foreach
PROPS = settings(max_examples=60, deadline=None, database=None)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
KERNELS = st.sampled_from([None, False, True])  # engine.optim's `fused`


@st.composite
def leaf_specs(draw) -> list[tuple[Any, ...] | None]:
    """Per leaf: None (not on this rank) or (shape, dtype, param transposed, grad transposed)."""
    def leaf(shape):
        dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16)))
        two_d = len(shape) == 2
        return shape, dtype, two_d and draw(st.booleans()), two_d and draw(st.booleans())
    shapes = st.sampled_from([(), (1,), (7,), (0,), (3, 5), (4, 9), (2, 3, 2), (33,)])
    return draw(st.lists(st.one_of(st.none(), shapes.map(leaf)), min_size=1, max_size=7))


def make_tree(specs: list, seed: int, steps: int, device: str = "cpu") -> tuple[Any, list[Any]]:
    """A params tree and `steps` grad trees: `{"head": leaf 0, "blocks": [{"w": leaf i}, ...]}`."""
    gen = torch.Generator().manual_seed(seed)

    def tensor(shape, dtype, transposed):
        x = torch.randn(shape[::-1] if transposed else shape, generator=gen, dtype=torch.float64)
        x = x.to(device=device, dtype=dtype)
        return x.t() if transposed else x  # transposed: strides (1, n)

    def tree(leaves):
        return {"head": leaves[0], "blocks": [{"w": x} for x in leaves[1:]]}
    params = tree([None if s is None else tensor(s[0], s[1], s[2]) for s in specs])
    grads = [tree([None if s is None else tensor(s[0], s[1], s[3]) for s in specs]) for _ in range(steps)]
    return params, grads


def goes_fused(p: torch.Tensor, g: torch.Tensor, fused: bool | None) -> bool:
    """The documented rule: fused for float32/float64 leaves (fused=True: every dtype with a fused kernel on
    the device) whose param and grad are contiguous."""
    dtypes = optim_kernels.FUSED_DTYPES[p.device.type] if fused else FUSABLE
    return fused is not False and p.dtype in dtypes and p.is_contiguous() and g.is_contiguous()


def lacks_fused_kernel(params: Any) -> bool:
    return any(x.dtype not in optim_kernels.FUSED_DTYPES[x.device.type] for x in tensors_at(params).values())


def torch_reference(cls, kw: dict, params: Any, grads: list[Any], fused: bool | None):
    """Every local leaf stepped by torch.optim `foreach=True`, and the ones engine.optim fuses by `fused=True`
    too: returns ({flat index: (param, torch state)}, same for fused) after all steps."""
    flat, g_flat = tensors_at(params), [tensors_at(g) for g in grads]
    out = {}
    for mode, pick in (("foreach", flat), ("fused", {i: p for i, p in flat.items()
                                                     if goes_fused(p, g_flat[0][i], fused)})):
        copies = {i: torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device).copy_(p)
                  for i, p in pick.items()}
        if not copies:
            out[mode] = {}
            continue
        opt = cls(list(copies.values()), **kw, **{mode: True})
        for g in g_flat:
            for i, x in copies.items():
                x.grad = g[i].clone()
            opt.step()
        out[mode] = {i: (x, opt.state[x]) for i, x in copies.items()}
    return out["foreach"], out["fused"]


def tensors_at(tree: Any) -> dict[int, torch.Tensor]:
    return {i: x for i, x in enumerate(pytree.tree_leaves(tree, is_leaf=lambda v: v is None)) if x is not None}


def snapshot(*trees: Any) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]:
    return [(x, x.clone(), x.stride()) for x in pytree.tree_leaves(trees) if isinstance(x, torch.Tensor)]


def run_ours(fn, params: Any, grads: list[Any], kw: dict) -> tuple[Any, dict]:
    """Steps engine.optim, checking after each step that no input was written and no output aliases one."""
    ours, state = params, None
    for g in grads:
        before = snapshot(ours, g, state)
        new, new_state = fn(ours, g, state, **kw)
        for x, copy, stride in before:  # inputs hold the numbers and strides they had before the call
            assert torch.equal(x, copy) and x.stride() == stride
        inputs = {x.untyped_storage().data_ptr() for x, _, _ in before if x.numel()}
        for i, x in tensors_at(new).items():
            assert x.numel() == 0 or x.untyped_storage().data_ptr() not in inputs, i
            assert x.dtype == tensors_at(ours)[i].dtype and x.shape == tensors_at(ours)[i].shape
        ours, state = new, new_state
    return ours, state


def assert_matches(ours: dict, ours_state: dict[str, dict], foreach: dict, fused: dict, keys: dict[str, str]) -> None:
    """Each leaf and its state equal torch's run of the kernel the leaf took (1e-12: bit for bit in practice),
    and float64 leaves equal torch's foreach run whichever kernel they took. (Float32 fused and foreach runs
    differ by rounding; on CUDA the fused kernel even rounds the bias corrections to float32, 1e-4 off
    when beta2 is near 1.)"""
    for i, x in ours.items():
        ref, ref_state = fused.get(i, foreach[i])
        assert max_relative_error([x], [ref]) <= 1e-12, (i, x.dtype)
        for name, key in keys.items():
            assert max_relative_error([ours_state[name][i]], [ref_state[key]]) <= 1e-12, (i, name)
        if x.dtype == torch.float64:
            assert max_relative_error([x], [foreach[i][0]]) <= 1e-12, i


@pytest.mark.parametrize("device", DEVICES)
@PROPS
@given(specs=leaf_specs(), seed=st.integers(0, 2**16), steps=st.integers(1, 4), fused=KERNELS, lr=st.floats(1e-4, 0.5),
       beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999), eps=st.floats(1e-10, 1e-3),
       weight_decay=st.sampled_from([0.0, 0.01, 0.3]))
def test_adamw_equals_torch_adamw_on_random_trees(device, specs, seed, steps, fused, lr, beta1, beta2, eps,
                                                  weight_decay):
    params, grads = make_tree(specs, seed, steps, device)
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    if fused and lacks_fused_kernel(params):  # bfloat16 on CPU
        with pytest.raises(EngineError, match=r"leaf '.*' \(torch.bfloat16 on cpu\) has no fused AdamW kernel"):
            optim.adamw(params, grads[0], None, fused=True, **kw)
        return
    ours, state = run_ours(optim.adamw, params, grads, dict(kw, fused=fused))
    foreach, fused_ref = torch_reference(torch.optim.AdamW, kw, params, grads, fused)
    assert state["step"] == steps and pytree.tree_structure(ours) == pytree.tree_structure(params)
    assert set(tensors_at(state["exp_avg"])) == set(tensors_at(state["exp_avg_sq"])) == set(tensors_at(params))
    states = {k: tensors_at(state[k]) for k in ("exp_avg", "exp_avg_sq")}
    assert_matches(tensors_at(ours), states, foreach, fused_ref, {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"})


@pytest.mark.parametrize("device", DEVICES)
@PROPS
@given(specs=leaf_specs(), seed=st.integers(0, 2**16), steps=st.integers(1, 4), fused=KERNELS, lr=st.floats(1e-4, 0.5),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), dampening=st.sampled_from([0.0, 0.3]),
       nesterov=st.booleans(), weight_decay=st.sampled_from([0.0, 0.01, 0.3]))
def test_sgd_equals_torch_sgd_on_random_trees(device, specs, seed, steps, fused, lr, momentum, dampening, nesterov,
                                              weight_decay):
    if nesterov and (momentum == 0 or dampening != 0):
        return  # torch.optim refuses it as engine.optim does
    params, grads = make_tree(specs, seed, steps, device)
    kw = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    if fused and lacks_fused_kernel(params):
        with pytest.raises(EngineError, match=r"has no fused SGD kernel.*pass fused=None"):
            optim.sgd(params, grads[0], None, fused=True, **kw)
        return
    ours, state = run_ours(optim.sgd, params, grads, dict(kw, fused=fused))
    foreach, fused_ref = torch_reference(torch.optim.SGD, kw, params, grads, fused)
    keys = {"momentum": "momentum_buffer"} if momentum else {}
    assert momentum or not tensors_at(state["momentum"])
    assert_matches(tensors_at(ours), {"momentum": tensors_at(state["momentum"])}, foreach, fused_ref, keys)


@pytest.mark.parametrize("fused", [None, False])
def test_a_leaf_without_a_grad_keeps_its_param_and_state(fused):
    params, grads = tree(0), [tree(s) for s in (1, 2)]
    _, state = optim.adamw(params, grads[0], None, lr=0.1, fused=fused)
    partial = {**grads[1], "w": None}
    new, new_state = optim.adamw(params, partial, state, lr=0.1, fused=fused)
    assert new["w"] is params["w"] and new_state["exp_avg"]["w"] is state["exp_avg"]["w"]
    assert not torch.equal(new["s"], params["s"]) and new_state["step"] == 2
    new, new_state = optim.sgd(params, partial, {"step": 1, "momentum": grads[0]}, lr=0.1, momentum=0.9, fused=fused)
    assert new["w"] is params["w"] and new_state["momentum"]["w"] is grads[0]["w"]


def test_state_saved_and_loaded_by_checkpoint_steps_on_as_if_never_stopped(tmp_path):
    """Mixed float32/float64 leaves and a None leaf: 2 steps, save, load, 2 steps == 4 steps == torch.optim."""
    params, grads = make_tree([((4, 3), torch.float32, False, False), None, ((5,), torch.float64, False, False),
                               ((3, 4), torch.float64, True, False), ((), torch.float32, False, False)], 7, 4)
    kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    straight, _ = run_ours(optim.adamw, params, grads, kw)
    half, state = run_ours(optim.adamw, params, grads[:2], kw)
    checkpoint.save(tmp_path / "c", None, half, state)
    loaded, loaded_state = checkpoint.load(tmp_path / "c", None, params)
    assert loaded_state["step"] == 2 and loaded_state["exp_avg"]["blocks"][0]["w"] is None
    for g in grads[2:]:
        loaded, loaded_state = optim.adamw(loaded, g, loaded_state, **kw)
    assert all(torch.equal(a, b) for a, b in zip(tensors(loaded), tensors(straight)))
    foreach, fused_ref = torch_reference(torch.optim.AdamW, kw, params, grads, None)
    states = {k: tensors_at(loaded_state[k]) for k in ("exp_avg", "exp_avg_sq")}
    assert_matches(tensors_at(loaded), states, foreach, fused_ref, {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"})


def test_fused_paths_are_taken_and_errors_name_the_leaf():
    params = {"a": torch.randn(3, 4), "b": torch.randn(4, 3).t(), "c": torch.randn(5, dtype=torch.bfloat16)}
    grads = pytree.tree_map(lambda x: torch.randn(x.shape, dtype=x.dtype), params)
    groups = optim_kernels.split(*[pytree.tree_leaves(t) for t in (params, grads)], [], fused=None, opt="SGD",
                                       name=str)
    assert {g.index: (g.dtype, g.fused) for g in groups} == {  # the transposed leaf can't go fused
        (0,): (torch.float32, True), (1,): (torch.float32, False), (2,): (torch.bfloat16, False)}
    with pytest.raises(EngineError, match=r"leaf 'c' \(torch.bfloat16 on cpu\) has no fused SGD kernel"):
        optim.sgd(params, grads, lr=0.1, fused=True)
    with pytest.raises(EngineError, match=r"grad of leaf 'b' is torch.float64\[3, 4\] on cpu, its param is "
                                          r"torch.float32\[3, 4\] on cpu; .*\.to\(param.dtype\)"):
        optim.adamw(params, {**grads, "b": grads["b"].double()}, lr=0.1)
    with pytest.raises(EngineError, match=r"grad of leaf 'a' is torch.float32\[4, 3\]"):
        optim.adamw(params, {**grads, "a": grads["a"].t()}, lr=0.1)


@pytest.mark.parametrize("fused", [None, False])
def test_without_foreach_clone_as_on_torch_2_11_the_numbers_are_the_same(monkeypatch, fused):
    """torch 2.11 has no torch._foreach_clone: the copies come from empty_like + one _foreach_copy_."""
    specs = [((4, 3), torch.float32, False, False), ((3, 4), torch.float64, True, True), None,
             ((5,), torch.bfloat16, False, False)]
    params, grads = make_tree(specs, 3, 3)
    for fn, kw in ((optim.adamw, dict(lr=0.01, weight_decay=0.1)), (optim.sgd, dict(lr=0.1, momentum=0.9))):
        with monkeypatch.context() as m:
            m.setattr(optim_kernels, "FOREACH_CLONE", None)
            m.setattr(torch, "_foreach_clone", None, raising=False)
            without, _ = run_ours(fn, params, grads, dict(kw, fused=fused))
        with_clone, _ = run_ours(fn, params, grads, dict(kw, fused=fused))
        pairs = list(zip(tensors(without), tensors(with_clone)))
        assert len(pairs) == 3 and all(torch.equal(a, b) and a.stride() == b.stride() for a, b in pairs)
