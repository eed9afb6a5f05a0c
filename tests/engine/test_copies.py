"""Copy-engine channels (`engine.execution.copies`): rings, counts and the transport's setup, on host memory.

The CUDA side (cuMemcpyDtoDAsync into a peer's ring opened by CUDA IPC, stream memory operations on registered
pages) runs on GPUs only: tests/mpi/equivalence.py over NCCL with FNPIPE_P2P=copy covers it there. Here a driver
does on the host what the GPU would do at the same addresses: copies move bytes, writes store counts, and each
wait records whether the GPU's cyclic >= would have let it through at that moment.
"""
from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from engine.errors import CommTimeoutError, PlanError
from engine.execution import copies, gates
from engine.execution.transport import DistTransport, Hub, LocalTransport


@pytest.fixture(autouse=True)
def queues(monkeypatch):
    """Copy-engine channels need their hardware queues (`gates.queues_short`); engine.init asks for them."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", str(gates.QUEUES))


class HostDriver:
    def __init__(self) -> None:
        self.waits: list[tuple[int, int, bool]] = []  # (value asked for, flag then, passed)

    def register(self, address: int, size: int) -> int:
        return address

    def unregister(self, address: int) -> None:
        pass

    def write(self, stream, device_address: int, value: int) -> None:
        ctypes.c_uint32.from_address(device_address).value = value

    def wait(self, stream, device_address: int, value: int) -> None:
        flag = ctypes.c_uint32.from_address(device_address).value
        self.waits.append((value, flag, gates.after(flag, value)))

    def copy(self, stream, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def export(self, address: int) -> tuple[str, int]:
        return address.to_bytes(64, "little").hex(), 0  # one process: the "handle" is the address

    def open(self, handle: str) -> int:
        return int.from_bytes(bytes.fromhex(handle), "little")

    def close(self, address: int) -> None:
        pass

    def stream(self, device):
        raise AssertionError("no copy stream on CPU")


def pair(depth: int = 2, size: int = 64, timeout: float = 30.0):
    """Ranks 0 and 1 of a world of 2, with a channel each way; each receives messages of up to `size` bytes."""
    import uuid

    token = uuid.uuid4().hex
    paths = {r: f"/dev/shm/fnpipe-copies-test-{token}-{r}" for r in range(2)}
    pages = [gates.Flags(p, copies.words(2), create=True) for p in paths.values()]
    drivers = [HostDriver(), HostDriver()]
    ends = [copies.Copies(r, 2, paths, torch.device("cpu"), drivers[r], timeout) for r in range(2)]
    exported = [ends[r].rings({1 - r: size}, depth) for r in range(2)]
    for e in ends:
        e.connect(exported)
    del pages
    for p in paths.values():
        import os
        os.unlink(p)
    return ends, drivers


def test_messages_cross_through_the_ring_in_order_and_each_slot_is_reused_only_once_copied_out():
    (a, b), (da, db) = pair(depth=2, size=64)
    sent = [torch.arange(n, dtype=torch.float32) * (k + 1) for k, n in enumerate([16, 3, 16, 7, 1])]
    got = [torch.empty_like(t) for t in sent]
    a.send(1, sent[0])
    a.send(1, sent[1])
    b.receive(0, got[0], pooled=True)
    a.send(1, sent[2])  # slot 0 again: message 1 has been copied out
    b.receive(0, got[1], pooled=True)
    b.receive(0, got[2], pooled=True)
    a.send(1, sent[3])
    a.send(1, sent[4])
    b.receive(0, got[3], pooled=True)
    b.receive(0, got[4], pooled=True)
    for s, g in zip(sent, got):
        assert torch.equal(s, g)
    # the sender waited for "freed >= n - depth" from its third message on; every wait would have passed
    assert [(v, ok) for v, _, ok in da.waits] == [(1, True), (2, True), (3, True)]
    assert [(v, ok) for v, _, ok in db.waits] == [(n, True) for n in range(1, 6)]
    assert b.own.read(0) == 5 and a.own.read(2 + 1) == 5  # ready in b's page, freed in a's


def test_a_full_ring_holds_the_sender_until_the_receiver_frees_a_slot():
    (a, b), (da, db) = pair(depth=2, size=64)
    for k in range(2):
        a.send(1, torch.full((4,), float(k)))
    b.receive(0, torch.empty(4), pooled=True)
    a.send(1, torch.full((4,), 2.0))
    assert da.waits[-1] == (1, 1, True)
    a.send(1, torch.full((4,), 3.0))  # message 2 is still in slot 1: on the GPU this copy waits
    assert da.waits[-1] == (2, 1, False)
    db.waits.clear()
    b.receive(0, torch.empty(4), pooled=True)
    b.receive(0, torch.empty(4), pooled=True)
    b.receive(0, torch.empty(4), pooled=True)
    b.receive(0, torch.empty(4), pooled=True)  # a fifth message was never sent: this receive waits
    assert [ok for _, _, ok in db.waits] == [True, True, True, False]


def test_both_directions_are_independent_channels():
    (a, b), _ = pair(depth=1, size=16)
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3, 4, 5], dtype=torch.int64)
    a.send(1, x)
    b.send(0, y)
    gx, gy = torch.empty(2), torch.empty(3, dtype=torch.int64)
    b.receive(0, gx, pooled=False)
    a.receive(1, gy, pooled=False)
    assert torch.equal(gx, x) and torch.equal(gy, y)


def test_only_messages_that_fit_a_slot_on_a_channel_of_ours_go_through_the_copy_engine():
    (a, b), _ = pair(depth=2, size=64)  # a slot holds ALIGN bytes: 64 float32
    assert a.carries("send", 1, torch.empty(64)) and b.carries("recv", 0, torch.empty(64))
    assert not a.carries("send", 1, torch.empty(65)) and not b.carries("recv", 0, torch.empty(65))
    assert not a.carries("send", 0, torch.empty(1))  # no channel to itself
    assert copies.capacity(1) == copies.ALIGN and copies.capacity(copies.ALIGN + 1) == 2 * copies.ALIGN


def test_release_opens_every_count_this_rank_waits_on():
    (a, b), (da, db) = pair(depth=1, size=16)
    a.send(1, torch.empty(1))
    a.send(1, torch.empty(1))  # the ring has one slot: this copy waits for a free that has not come
    for _ in range(3):
        b.receive(0, torch.empty(1), pooled=True)  # the third waits for a message never sent
    assert da.waits == [(1, 0, False)] and [ok for _, _, ok in db.waits] == [True, True, False]
    a.release()
    b.release()
    assert all(gates.after(b.own.read(0), n) for n in range(1, 4))  # past every receive queued
    assert all(gates.after(a.own.read(2 + 1), n) for n in range(1, 2))  # past every free a send waits for


class Stuck:
    def query(self) -> bool:
        return False


def test_a_transfer_not_done_within_the_timeout_fails_the_transport_and_opens_its_counts():
    (a, b), _ = pair(timeout=0.05)
    b.receive(0, torch.empty(1), pooled=True)
    late = copies.CopyWork(Stuck(), torch.device("cpu"), "receive 2 from rank 0", 0)
    late.posted -= 1.0
    with b.lock:
        b.works.append(late)
    deadline = time.monotonic() + 5
    while b.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the watch thread finds it
    assert b.failure is not None and "receive 2 from rank 0" in b.failure and b.late_peer == 0
    assert gates.after(b.own.read(0), 1)  # opened from the host
    b.close()
    a.close()
    assert not b.watch.is_alive()


def test_an_ipc_handle_crosses_as_hex_with_every_byte_even_zeros():
    raw = bytes([0, 7, 0, 0, 255] + list(range(59)))
    text = raw.hex()
    assert copies.handle_hex(copies.handle_of(text)) == text and len(text) == 128


@pytest.mark.parametrize("name,value,message", [("FNPIPE_P2P", "cpoy", "nccl"), ("FNPIPE_COPY_SLOTS", "0", ">= 1"),
                                                ("FNPIPE_COPY_SLOTS", "two", ">= 1")])
def test_bad_switches_name_the_fix(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(PlanError, match=message):
        copies.wanted() if name == "FNPIPE_P2P" else copies.depth()


def test_the_switch_is_off_by_default_and_needs_nccl_on_a_gpu(monkeypatch):
    monkeypatch.delenv("FNPIPE_P2P", raising=False)
    assert not copies.wanted()
    monkeypatch.setenv("FNPIPE_P2P", "copy")
    assert copies.wanted() and not copies.asks(True, torch.device("cpu")) and not copies.asks(False, torch.device("cuda"))
    assert copies.asks(True, torch.device("cuda"))


# -- the transport's side: setup over a collective, posts routed by size -----------------------------------------
def shells(world: int, channels: list[tuple[int, int]], hub: Hub) -> list[DistTransport]:
    """DistTransports without torch.distributed: their collectives go through an in-process hub."""
    out = []
    for r in range(world):
        t = object.__new__(DistTransport)
        local = LocalTransport(hub, r)
        t.rank, t.world_size, t.timeout, t.nccl, t.device = r, world, 30.0, True, torch.device("cpu")
        t.channels = {c: None for c in channels}
        t.gates, t.copies, t.prepared, t.rings = None, None, False, {}
        t.all_gather_json = local.all_gather_json
        out.append(t)
    return out


def run_ranks(fn, world: int) -> list:
    out, errors = [None] * world, []

    def one(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,), name=f"rank {r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def test_the_transport_opens_rings_where_both_ends_ask_and_routes_each_message_by_its_size(monkeypatch):
    monkeypatch.setattr(copies, "asks", lambda nccl, device: True)
    monkeypatch.delenv("FNPIPE_COPY_SLOTS", raising=False)
    ts = shells(3, [(0, 1), (1, 2), (2, 1)], Hub(3, 30.0))
    receives = [{}, {0: 64, 2: 32}, {1: 64}]
    made = run_ranks(lambda r: ts[r]._open_copies(receives[r], driver=HostDriver()), 3)
    assert sorted(made[1].incoming) == [0, 2] and sorted(made[1].outgoing) == [2]
    assert sorted(made[0].outgoing) == [1] and not made[0].incoming
    assert made[1].incoming[2].capacity == copies.ALIGN  # 32 bytes asked, rounded up
    for r, m in enumerate(made):
        ts[r].copies = m
    slot = copies.ALIGN * copies.DEPTH  # a ring of each 64- or 32-byte channel: DEPTH slots of ALIGN bytes
    assert [ts[0].resident_bytes(r) for r in range(3)] == [0, 2 * slot, slot]  # every rank knows every rank's
    x = torch.arange(8, dtype=torch.float32)
    (sent,) = ts[0].post([("send", 1, x)])
    assert isinstance(sent.work, copies.CopyWork) and made[0].outgoing[1].sent == 1
    got = torch.empty(8)
    (h,) = ts[1].post([("recv", 0, got)], pooled=True)
    ts[1].wait(h, "receiving")
    assert torch.equal(got, x)
    big = torch.empty(65)  # 260 bytes: past rank 1's slot for rank 0, so NCCL's (torch.distributed is not up here)
    assert not made[0].carries("send", 1, big) and not made[1].carries("recv", 0, big)
    for m in made:
        m.close()


def test_a_rank_that_does_not_ask_leaves_its_channels_on_nccl(monkeypatch):
    monkeypatch.setattr(copies, "asks", lambda nccl, device: threading.current_thread().name != "rank 2")
    ts = shells(3, [(0, 1), (1, 2)], Hub(3, 30.0))
    receives = [{}, {0: 64}, {1: 64}]
    made = run_ranks(lambda r: ts[r]._open_copies(receives[r], driver=HostDriver()), 3)
    assert made[2] is None and sorted(made[1].incoming) == [0] and not made[1].outgoing
    for m in made:
        if m is not None:
            m.close()


def test_a_rank_failing_to_make_its_ring_leaves_every_channel_on_nccl(monkeypatch):
    monkeypatch.setattr(copies, "asks", lambda nccl, device: True)

    class Refuses(HostDriver):
        def export(self, address: int):
            raise RuntimeError("cuIpcGetMemHandle failed with CUDA driver error 1")  # e.g. expandable segments

    ts = shells(2, [(0, 1), (1, 0)], Hub(2, 30.0))
    drivers = [HostDriver(), Refuses()]
    made = run_ranks(lambda r: ts[r]._open_copies({1 - r: 64}, driver=drivers[r]), 2)
    assert made == [None, None]


def test_a_failed_transport_raises_at_its_next_call_naming_the_peer(monkeypatch):
    monkeypatch.setattr(copies, "asks", lambda nccl, device: True)
    ts = shells(2, [(0, 1), (1, 0)], Hub(2, 30.0))
    made = run_ranks(lambda r: ts[r]._open_copies({1 - r: 64}, driver=HostDriver()), 2)
    ts[1].copies = made[1]
    made[1].failure, made[1].late_peer = "receive 1 from rank 0 (copy engine) not done 30.0 s after it was posted", 0
    with pytest.raises(CommTimeoutError, match="rank 1: posting transfers failed .*rank 0 died or hangs"):
        ts[1].post([("recv", 0, torch.empty(1))])
    for m in made:
        m.close()


def test_a_failure_taints_every_peer_and_each_step_end_raises_on_the_ranks_it_reached():
    """Rank 0 fails (a transfer past its timeout): before it opens its counts (after which its queued copies may
    land in rank 1's slots out of turn) it writes its rank into rank 1's page; rank 1's watch and the end of its
    step both see it, so rank 1 never returns a step on data rank 0 may have touched."""
    (a, b), _ = pair()
    assert b.tainted() is None and b.settle() is None
    a.fail("send 3 to rank 1 (copy engine) not done 8.0 s after it was posted", 1)
    assert a.failure.startswith("send 3") and a.late_peer == 1
    assert b.tainted() == 0
    reason = b.settle()
    assert reason is not None and "rank 0's copy-engine transfers failed" in reason and b.late_peer == 0
    assert gates.after(b.own.read(0), 1)  # rank 1 opened its own counts in turn
    a.close()
    b.close()


def test_the_end_of_a_step_raises_where_the_copy_engine_channels_failed(monkeypatch):
    monkeypatch.setattr(copies, "asks", lambda nccl, device: True)
    ts = shells(2, [(0, 1), (1, 0)], Hub(2, 30.0))
    made = run_ranks(lambda r: ts[r]._open_copies({1 - r: 64}, driver=HostDriver()), 2)
    for r, m in enumerate(made):
        ts[r].copies = m
    ts[0].settle("finishing the step")  # nothing failed: nothing raised
    made[1].fail("receive 1 from rank 0 (copy engine) not done 30.0 s after it was posted", 0)
    with pytest.raises(CommTimeoutError, match="rank 0: finishing the step failed .* rank 1's copy-engine"):
        ts[0].settle("finishing the step")
    for m in made:
        m.close()


def test_prepare_is_collective_once_and_every_rank_knows_every_ranks_rings(monkeypatch):
    """Rank 2 does not ask, so it opens nothing; a second Step on the same transports calls `prepare` again, and
    no rank gathers a second time (a rank left without rings must not wait for the others). Every rank reports
    the same rings for every rank, whatever it opened itself."""
    monkeypatch.setattr(copies, "asks", lambda nccl, device: threading.current_thread().name != "rank 2")
    monkeypatch.setattr(copies, "CudaDriver", HostDriver)
    monkeypatch.delenv("FNPIPE_COPY_SLOTS", raising=False)
    ts = shells(3, [(0, 1), (1, 2)], Hub(3, 2.0))
    receives = [{}, {0: 64}, {1: 64}]
    run_ranks(lambda r: ts[r].prepare(receives[r]), 3)
    assert ts[2].copies is None and ts[1].copies is not None
    for t in ts:  # one after another: a gather here would time out (the hub's 2 s)
        t.prepare({0: 1 << 20})
    ring = copies.ALIGN * copies.DEPTH
    assert [[t.resident_bytes(r) for r in range(3)] for t in ts] == [[0, ring, 0]] * 3
    for t in ts:
        if t.copies is not None:
            t.copies.close()


def test_a_bad_setting_on_one_rank_is_every_ranks_error_not_a_timeout(monkeypatch):
    monkeypatch.setattr(copies, "asks", lambda nccl, device: True)

    def depth() -> int:
        if threading.current_thread().name == "rank 1":
            raise PlanError("FNPIPE_COPY_SLOTS='0': give the slots per copy-engine ring, a whole number >= 1")
        return 2

    monkeypatch.setattr(copies, "depth", depth)
    ts = shells(2, [(0, 1), (1, 0)], Hub(2, 30.0))
    seen: list[str] = []

    def one(r: int) -> None:
        try:
            ts[r]._open_copies({1 - r: 64}, driver=HostDriver())
        except PlanError as exc:
            seen.append(f"{r}: {exc}")

    run_ranks(one, 2)
    assert sorted(x[:2] for x in seen) == ["0:", "1:"] and all("rank 1: FNPIPE_COPY_SLOTS='0'" in x for x in seen)


def test_engine_init_reserves_the_queues_only_when_asked_and_before_cuda(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("FNPIPE_P2P", raising=False)
    monkeypatch.delenv("FNPIPE_GATED_RECV", raising=False)
    copies.reserve_queues()
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in __import__("os").environ
    monkeypatch.setenv("FNPIPE_P2P", "copy")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    copies.reserve_queues()
    assert __import__("os").environ["CUDA_DEVICE_MAX_CONNECTIONS"] == str(gates.QUEUES)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "12")  # the user's choice stays (and is judged short)
    copies.reserve_queues()
    assert __import__("os").environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "12"


def test_close_while_the_watch_sweeps_keeps_the_transport_whole():
    """The watch pops finished transfers under the lock while `close` looks at them: many rounds, no error."""
    for _ in range(20):
        (a, b), _ = pair(timeout=0.01)
        for k in range(50):
            a.send(1, torch.full((2,), float(k)))
            b.receive(0, torch.empty(2), pooled=True)
        a.close()
        b.close()
        assert a.failure is None and b.failure is None and not a.outgoing and not b.incoming


def test_engine_init_refuses_a_bad_slot_count_before_any_communication(monkeypatch):
    monkeypatch.setenv("FNPIPE_P2P", "copy")
    monkeypatch.setenv("FNPIPE_COPY_SLOTS", "-1")
    with pytest.raises(PlanError, match="FNPIPE_COPY_SLOTS='-1'"):
        copies.reserve_queues()
