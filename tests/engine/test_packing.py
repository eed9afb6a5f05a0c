"""Packed transfers (engine/execution/packing.py): layouts, round trips, equivalence, message counts, memory replay."""
from __future__ import annotations

import re
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
import ir
from engine.execution import packing
from engine.execution.inprocess import build_steps, run_steps
from engine.execution.transport import LocalTransport
from engine.testing import assert_parallel_equivalent
from tests.mpi import packing as job
from tests.mpi.jobs import BIN, job_env, launch

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
          torch.uint8]
avals = st.lists(st.builds(lambda shape, dtype: ir.AbstractValue(tuple(shape), dtype),
                           st.lists(st.integers(0, 40), max_size=3), st.sampled_from(DTYPES)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(avals, st.integers(0, 512), st.integers(0, 2048))
def test_a_layout_sends_every_tensor_once_aligned_and_bounded(avs: list, small: int, extra: int) -> None:
    pack = small + extra
    lay = packing.layout(avs, small=small, pack=pack)
    assert sorted(k for m in lay.messages for k in m.members) == list(range(len(avs)))
    assert [m.members[0] for m in lay.messages] == sorted(m.members[0] for m in lay.messages)
    for m in lay.messages:
        if not m.packed:
            assert len(m.members) == 1 and m.nbytes == avs[m.members[0]].nbytes
            continue
        assert len(m.members) >= 2 and all(avs[k].nbytes <= small for k in m.members)
        assert m.nbytes % packing.ALIGN == 0 and m.nbytes <= -(-pack // packing.ALIGN) * packing.ALIGN
        spans = [(off, off + avs[k].nbytes) for k, off in zip(m.members, m.offsets)]
        assert all(a % packing.ALIGN == 0 for a, _ in spans) and spans[-1][1] <= m.nbytes
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # in order, never overlapping
    for k, a in enumerate(avs):  # only what is too big, or alone, travels as itself
        alone = [m for m in lay.messages if m.members == (k,)]
        assert bool(alone) == (a.nbytes > small or not any(k in m.members for m in lay.messages if m.packed))


def _tensor(a: ir.AbstractValue, g: torch.Generator) -> torch.Tensor:
    if a.dtype.is_floating_point:
        return torch.randn(a.shape, generator=g, dtype=torch.float64).to(a.dtype)
    return torch.randint(0, 2 if a.dtype == torch.bool else 100, a.shape, generator=g).to(a.dtype)


@settings(max_examples=100, deadline=None)
@given(avals, st.integers(0, 256))
def test_what_is_sent_arrives_bit_for_bit_as_views_of_one_buffer(avs: list, small: int) -> None:
    g = torch.Generator().manual_seed(0)
    sent = [_tensor(a, g) for a in avs]
    sent = [t.t() if t.dim() == 2 else t[:1].expand(t.shape) if t.dim() == 1 and t.numel() > 1 else t
            for t in sent]  # a sender's value need not be contiguous (transposed, expanded: stride 0) ...
    avs = [ir.AbstractValue.of(t) for t in sent]  # ... but has the receiver's shape
    lay = packing.layout(avs, small=small)
    bufs, got = lay.receive(torch.device("cpu"))
    for src, dst in zip(lay.send(sent), bufs):
        assert src.dtype == dst.dtype and src.shape == dst.shape
        dst.copy_(src)  # what the transport does
    for m, buf in zip(lay.messages, bufs):
        for k in m.members:
            assert got[k].is_contiguous() and got[k].data_ptr() % packing.ALIGN == 0
            assert got[k].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    for a, b in zip(sent, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _count_posts(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, str], int]:
    """Patch the in-process transport to count the messages each rank posts, by op."""
    counts: dict[tuple[int, str], int] = {}
    post = LocalTransport.post

    def counting(self: LocalTransport, ops: Any, **kw: Any) -> list[Any]:
        for op, _, _ in ops:
            counts[(self.rank, op)] = counts.get((self.rank, op), 0) + 1
        return post(self, ops, **kw)

    monkeypatch.setattr(LocalTransport, "post", counting)
    return counts


@pytest.mark.parametrize("small,pack", [(None, None), (64, 160)])  # one pack; the activation alone, packs of ~2
@pytest.mark.parametrize("schedule", list(job.SCHEDULES))
def test_many_small_mixed_values_match_torch_func_in_process(schedule: str, small: Any, pack: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if small is not None:
        monkeypatch.setattr(packing, "SMALL", small)
        monkeypatch.setattr(packing, "PACK", pack)
    counts = _count_posts(monkeypatch)
    params, x, y = job.model()
    reference = torch.func.grad_and_value(job.loss_fn, has_aux=True)(params, x, y)
    plan = engine.plan(job.loss_fn, params, x, y, world_size=2, **job.plan_options(schedule))
    steps = build_steps(job.loss_fn, params, (x, y), plan, has_aux=True)
    result = run_steps(steps, params, (x, y))
    for got, _ in result.per_rank:  # every rank gets the full loss and aux
        e64, e32 = job.errors(got, result.grads, reference)
        assert e64 <= 1e-10 and e32 <= 1e-5, (schedule, e64, e32)
    for step in steps:
        ex = step.executor
        assert ex.bufs == {} and ex.pending == {} and ex.sends == []
        for op in ("send", "recv"):
            transfers = [c for ins in step.program.instrs for c in ins.comm if c.op == op]
            assert counts.get((step.world.rank, op), 0) == sum(len(ex.layouts(c).messages) for c in transfers)
            if small is None:  # everything here is small: one message a transfer, whatever it carries
                assert counts.get((step.world.rank, op), 0) == len(transfers) <= sum(len(c.bufs) for c in transfers)
    forward = [c for step in steps for ins in step.program.instrs for c in ins.comm
               if c.op == "send" and c.what == "act"]
    assert forward and all(len(c.bufs) > 1 for c in forward)  # an activation and a dozen small values a cut


def test_a_resnet_cut_in_two_sends_a_message_or_two_per_microbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny wide ResNet in BatchNorm train mode: its cut carries an activation and a partial statistic
    or two per BatchNorm layer before it (aux leaves for the last stage); they travel as two messages."""
    from examples.resnet_model import WideResNet

    counts = _count_posts(monkeypatch)
    torch.manual_seed(0)
    fn, variables = engine.functionalize(WideResNet(50, 1, classes=5, base=1).double().train(), loss=F.cross_entropy)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (4,))
    programs: dict[int, Any] = {}
    assert_parallel_equivalent(fn, variables, x, y, schedule="1f1b", microbatches=2,
                               hook=lambda ex, ins: programs.setdefault(ex.program.rank, ex.program) and None)
    sends = [c for ins in programs[0].instrs for c in ins.comm if c.op == "send"]
    tensors = sum(len(c.bufs) for c in sends) // 2  # per microbatch
    assert tensors >= 20, tensors  # many small values cross the cut ...
    assert counts[(0, "send")] <= 2 * 2 and counts[(1, "recv")] == counts[(0, "send")]  # ... in <= 2 messages each
    assert counts[(1, "send")] <= 2 * 2  # and the grads come back in as few


@pytest.mark.parametrize("rank", [0, 1])
def test_the_replay_holds_a_received_pack_until_its_last_view_dies(rank: int) -> None:
    """Before each instruction, what the executor holds is what the footprint replay said was held after the
    previous one: received buffers counted by the storages behind them (a pack once, however many of its
    views live), the rest by their tensors' own bytes (as the replay counts compute outputs)."""
    params, x, y = job.model()
    plan = engine.plan(job.loss_fn, params, x, y, world_size=2, **job.plan_options("1f1b"))
    seen: list[int] = []

    def hook(ex: Any, ins: Any) -> None:
        if ex.program.rank != rank:
            return
        received = {b for i in ex.program.instrs for c in i.comm if c.op == "recv" for b in c.bufs}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for r, t in ex.bufs.items() if r in received}
        own = sum(t.nbytes for r, t in ex.bufs.items() if r not in received)
        seen.append(sum(storages.values()) + own + sum(g.nbytes for g in ex.grads.values()))

    steps = build_steps(job.loss_fn, params, (x, y), plan, has_aux=True, hook=hook)
    run_steps(steps, params, (x, y))
    fp = steps[rank].memory()[rank]
    packs = [m for ins in steps[rank].program.instrs for c in ins.comm if c.op == "recv"
             for m in steps[rank].executor.layouts(c).messages if m.packed]
    # each microbatch's activations and small values arrive as one pack (rank 1); the grads come back as the
    # activation's alone (rank 0): the aux partials and the masks' values get none (`ir.slicing.off_the_loss`)
    assert len(packs) == (4 if rank == 1 else 0)
    assert seen[1:] == [h - fp.static for h in fp.held[:len(seen) - 1]]


@pytest.mark.mpi
def test_many_small_mixed_values_match_torch_func_under_mpirun() -> None:
    out = launch([str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                  "tests/mpi/packing.py"], timeout=400, env=job_env())
    assert "FAIL" not in out, out
    ok = set(re.findall(r"^OK rank (\d) (\S+) max rel err", out, flags=re.M))
    assert ok == {(str(r), s) for r in range(2) for s in job.SCHEDULES}, out
    posts = re.findall(r"^OK rank (\d) (\S+) .* posts (\S+) (\S+)$", out, flags=re.M)
    assert len(posts) == 2 * len(job.SCHEDULES), out  # every rank's post measured, the same on both ranks
    for s in job.SCHEDULES:
        mine = {p[2:] for p in posts if p[1] == s}
        assert len(mine) == 1 and all(0 < float(t) < 1 for t in next(iter(mine))), out
