"""engine.functionalize: nn.Modules through the pipeline equal torch.func.grad; impure modules are refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import ir
from engine.execution.inprocess import build_steps, run_steps
from engine.training.module import ModuleError, flat_names, functionalize, load_into
from engine.planning.plan import Plan, StagePlan
from engine.testing import max_relative_error


def pipeline(fn, variables, batch, *, stages: int = 2, dp: int = 1, microbatches: int = 2, schedule: str = "1f1b"):
    """Loss and full grad tree of `fn` on `stages x dp` in-process ranks, cut into equal eqn counts."""
    graph = ir.trace(fn, variables, *[x[: len(x) // (microbatches * dp)] for x in batch])
    cuts = tuple(len(graph.eqns) * k // stages for k in range(1, stages))
    plan = Plan(schedule, stages, stages, dp, microbatches, cuts, tuple(StagePlan(k, 0, 0, k) for k in range(stages)))
    return run_steps(build_steps(fn, variables, batch, plan), variables, batch)


def reference(fn, variables, batch):
    """torch.func.grad with respect to the trainable params; buffers closed over (they may be integer)."""
    def of_params(params):
        return fn({"params": params, "buffers": variables["buffers"]}, *batch)
    grads, loss = torch.func.grad_and_value(of_params)(variables["params"])
    return loss, grads


def check_equivalent(fn, variables, batch, **kw) -> None:
    res = pipeline(fn, variables, batch, **kw)
    ref_loss, ref_grads = reference(fn, variables, batch)
    assert abs(res.loss.item() - ref_loss.item()) <= 1e-10 * abs(ref_loss.item())
    assert max_relative_error(res.grads["params"], ref_grads) <= 1e-10
    for name, g in flat_names(res.grads["buffers"]):  # constants for autodiff
        assert g is None or not g.is_floating_point() or g.abs().max() == 0, name


def test_transformer_through_pipeline_equals_func_grad():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                           dropout=0.0, batch_first=True).double()
    fn, variables = functionalize(model, loss=F.mse_loss, inputs=2)
    assert "params.encoder.layers.0.self_attn.in_proj_weight" in dict(flat_names(variables))
    src, tgt, y = torch.randn(4, 5, 16).double(), torch.randn(4, 3, 16).double(), torch.randn(4, 3, 16).double()
    assert torch.allclose(fn(variables, src, tgt, y), F.mse_loss(model(src, tgt), y))
    check_equivalent(fn, variables, (src, tgt, y))


class ConvNet(nn.Module):
    """ResNet-style: conv-GroupNorm-relu stem, a residual conv-norm block, pooled linear head."""

    def __init__(self, norm: str, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU())
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(8) if norm == "batch" else nn.GroupNorm(4, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = F.relu(h + self.norm(self.conv(h)))
        return self.head(h.mean(dim=(2, 3)))


def conv_case(norm: str = "group", train: bool = True):
    torch.manual_seed(1)
    model = ConvNet(norm).double()
    if norm == "batch":
        with torch.no_grad():  # non-trivial running statistics, so eval BN is not the identity
            model.norm.running_mean.uniform_(-0.5, 0.5)
            model.norm.running_var.uniform_(0.5, 2.0)
    model.train(train)
    return model, torch.randn(8, 3, 6, 6).double(), torch.randint(0, 5, (8,))


def test_convnet_with_groupnorm_equals_func_grad():
    model, x, y = conv_case("group")
    fn, variables = functionalize(model, loss=F.cross_entropy)
    assert variables["buffers"] == {}
    assert torch.allclose(fn(variables, x, y), F.cross_entropy(model(x), y))
    check_equivalent(fn, variables, (x, y), stages=3, microbatches=4)


def test_eval_batchnorm_buffers_are_constant_inputs():
    model, x, y = conv_case("batch", train=False)
    fn, variables = functionalize(model, loss=F.cross_entropy)
    assert sorted(n for n, _ in flat_names(variables["buffers"])) == [
        "norm.num_batches_tracked", "norm.running_mean", "norm.running_var"]
    assert torch.allclose(fn(variables, x, y), F.cross_entropy(model(x), y))
    check_equivalent(fn, variables, (x, y), stages=1, dp=2, microbatches=2)


def test_eval_batchnorm_split_across_stages():
    model, x, y = conv_case("batch", train=False)
    fn, variables = functionalize(model, loss=F.cross_entropy)
    check_equivalent(fn, variables, (x, y), stages=3, microbatches=2)


def test_batchnorm_in_train_mode_is_state_not_refused():
    """Train-mode BatchNorm returns its running statistics (tests/engine/test_batchnorm.py checks them)."""
    model, x, y = conv_case("batch", train=True)
    fn, variables = functionalize(model, loss=F.cross_entropy)
    assert ir.deferred_of(fn) is not None
    loss, state = fn(variables, x, y)
    assert loss.shape == () and set(state["buffers"]) == {"norm"}


def test_dropout_is_refused_unless_p_is_zero():
    with pytest.raises(ModuleError, match=r"'1' \(Dropout\) has dropout p=0.1 in train mode.*ir.random.dropout"):
        functionalize(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1)))
    with pytest.raises(ModuleError, match="attention dropout 0.2"):
        functionalize(nn.TransformerEncoderLayer(8, 2, dropout=0.2))
    fn, variables = functionalize(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0)), loss=F.mse_loss)
    assert len(ir.trace(fn, variables, torch.randn(2, 3), torch.randn(2, 3)).eqns) > 0  # no RNG op left


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[0])
        return self.lin(x).pow(2).mean()


class DropPath(nn.Module):
    """timm's stochastic depth in train mode: a mask from the global RNG (`bernoulli_` on a new tensor)."""

    def forward(self, x):
        mask = x.new_empty((x.shape[0], 1)).bernoulli_(0.9)
        return x * mask / 0.9


def test_drop_path_in_train_mode_is_refused_for_its_rng_at_the_modules_line():
    fn, variables = functionalize(nn.Sequential(nn.Linear(4, 4), DropPath()), loss=F.mse_loss)
    with pytest.raises(ir.TraceError) as caught:
        ir.trace(fn, variables, torch.randn(8, 4), torch.randn(8, 4))
    lines = str(caught.value).splitlines()
    assert lines[0] == "aten.bernoulli_.float draws from PyTorch's global random state"
    assert lines[1].endswith("in forward: mask = x.new_empty((x.shape[0], 1)).bernoulli_(0.9)")  # not engine's
    assert "test_module.py" in lines[1] and "in-place" not in str(caught.value)
    assert lines[-1].startswith("Fix: pass the randomness in") and "model.eval()" in lines[-1]


def test_buffer_mutation_is_refused_when_traced_and_when_called():
    fn, variables = functionalize(Counter())  # module returns its loss
    with pytest.raises(ModuleError, match=r"Counter wrote into buffer\(s\) \['seen'\] in place"):
        ir.trace(fn, variables, torch.randn(4, 3))
    with pytest.raises(ModuleError, match="seen"):
        fn(variables, torch.randn(4, 3))


def test_names_tied_weights_and_load_into():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(t))

    model = Tied().double()
    fn, variables = functionalize(model, loss=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    graph = ir.trace(fn, variables, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    assert graph.input_names == ("params.embed.weight", "x", "y")  # the tied head appears once
    new = pytree.tree_map(lambda t: t + 1.0, variables)
    load_into(model, new)
    assert torch.equal(model.out.weight, new["params"]["embed"]["weight"])
    with pytest.raises(ModuleError, match="pass the full tree"):
        load_into(model, {"params": {"embed": {"weight": None}}, "buffers": {}})
