"""Gated receives (`engine.execution.gates`): the flag pages and the counts, on host memory.

The CUDA side (stream memory operations on registered memory) runs on GPUs only: tests/mpi/equivalence.py
over NCCL covers it there. Here a driver that does on the host what the GPU would do with the same addresses.
"""
from __future__ import annotations

import ctypes
import os
import uuid

import pytest
import torch

from engine.execution import gates


class HostDriver:
    """`register` gives the host address back (the GPU would see the page there), `write` stores the value,
    `wait` records the value asked for, what the flag held and whether the GPU's cyclic >= would pass."""

    def __init__(self) -> None:
        self.waits: list[tuple[int, int]] = []
        self.passed: list[bool] = []
        self.registered: list[int] = []

    def register(self, address: int, size: int) -> int:
        self.registered.append(address)
        return address

    def unregister(self, address: int) -> None:
        self.registered.remove(address)

    def write(self, stream, device_address: int, value: int) -> None:
        ctypes.c_uint32.from_address(device_address).value = value

    def wait(self, stream, device_address: int, value: int) -> None:
        flag = ctypes.c_uint32.from_address(device_address).value
        self.waits.append((value, flag))
        self.passed.append(gates.after(flag, value))

    def stream(self, device):  # CUDA only; the CPU gates make none
        raise AssertionError("no gate stream on CPU")


@pytest.fixture
def paths():
    token = uuid.uuid4().hex
    out = {r: f"/dev/shm/fnpipe-gates-test-{token}-{r}" for r in range(3)}
    made = [gates.Flags(p, 3, create=True) for p in out.values()]
    yield out
    del made
    for p in out.values():
        os.unlink(p)


def test_sends_count_into_the_receivers_page_and_receives_wait_for_their_count(paths):
    cpu = torch.device("cpu")
    d0, d1, d2 = HostDriver(), HostDriver(), HostDriver()
    g0 = gates.Gates(0, 3, paths, incoming=[1], outgoing=[1], device=cpu, driver=d0)
    g1 = gates.Gates(1, 3, paths, incoming=[0, 2], outgoing=[0], device=cpu, driver=d1)
    g2 = gates.Gates(2, 3, paths, incoming=[], outgoing=[1], device=cpu, driver=d2)
    for _ in range(3):
        g0.sent_one(1)
    g2.sent_one(1)
    assert (g1.own.read(0), g1.own.read(2), g1.own.read(1)) == (3, 1, 0)  # a slot per sender, its own count
    posted = []
    for n in range(1, 4):
        assert g1.receive(0, torch.empty(2), lambda n=n: posted.append(n) or n, pooled=True) == n
    g1.receive(2, torch.empty(2), lambda: posted.append("from 2"), pooled=False)
    assert posted == [1, 2, 3, "from 2"]
    assert d1.waits == [(1, 3), (2, 3), (3, 3), (1, 1)] and all(d1.passed)  # the n-th receive waits for count n
    g1.sent_one(0)
    g0.receive(1, torch.empty(2), lambda: None, pooled=True)
    assert d0.waits == [(1, 1)] and g0.own.read(1) == 1
    assert len(d1.registered) == 2 and len(d0.registered) == 2 and len(d2.registered) == 2  # own page and peers'


def test_release_opens_every_gate_of_the_rank_from_the_host(paths):
    driver = HostDriver()
    g1 = gates.Gates(1, 3, paths, incoming=[0, 2], outgoing=[], device=torch.device("cpu"), driver=driver)
    for _ in range(5):
        g1.receive(0, torch.empty(1), lambda: None, pooled=True)  # five receives queued, none sent
    assert driver.passed == [False] * 5
    g1.release()
    assert g1.own.read(0) == 5 + gates.PAST and g1.own.read(2) == gates.PAST and g1.own.read(1) == 0
    assert all(gates.after(g1.own.read(0), n) for n in range(1, 6))  # past every wait queued on it
    g1.receive(2, torch.empty(1), lambda: None, pooled=True)
    assert driver.passed[-1]


def test_the_gpus_comparison_is_cyclic():
    """CU_STREAM_WAIT_VALUE_GEQ compares int32(flag - value) >= 0: an all-ones flag is *before* count 1."""
    assert gates.after(3, 3) and gates.after(4, 3) and not gates.after(2, 3)
    assert not gates.after(0xFFFFFFFF, 1) and gates.after(1, 0xFFFFFFFF)  # wrapped around
    assert gates.after(7 + gates.PAST, 7) and gates.after(7 + gates.PAST, 1)


def test_flags_of_every_world_rank_fit_the_page_whatever_ranks_are_gated():
    token = uuid.uuid4().hex
    paths = {0: f"/dev/shm/fnpipe-gates-test-{token}-0", 200: f"/dev/shm/fnpipe-gates-test-{token}-200"}
    made = [gates.Flags(p, 201, create=True) for p in paths.values()]
    try:
        g200 = gates.Gates(200, 201, paths, incoming=[], outgoing=[0], device=torch.device("cpu"), driver=HostDriver())
        g200.sent_one(0)
        g0 = gates.Gates(0, 201, paths, incoming=[200], outgoing=[], device=torch.device("cpu"), driver=HostDriver())
        assert g0.own.read(200) == 1 and g0.own.size >= 201 * gates.SLOT
    finally:
        del made
        for p in paths.values():
            os.unlink(p)


def test_a_page_cannot_be_made_twice(paths):
    with pytest.raises(FileExistsError):
        gates.Flags(paths[0], 3, create=True)


@pytest.mark.parametrize("name,value,expected", [
    ("FNPIPE_GATED_RECV", None, False), ("FNPIPE_GATED_RECV", "1", True), ("FNPIPE_GATED_RECV", "on", True),
    ("FNPIPE_GATED_RECV", "0", False), ("FNPIPE_GATED_RECV", "off", False),
    # gating needs a hardware queue per waiting stream: 32, not CUDA's default 8
    ("CUDA_DEVICE_MAX_CONNECTIONS", None, False), ("CUDA_DEVICE_MAX_CONNECTIONS", "8", False),
    ("CUDA_DEVICE_MAX_CONNECTIONS", "4", False), ("CUDA_DEVICE_MAX_CONNECTIONS", "1", False),
    ("CUDA_DEVICE_MAX_CONNECTIONS", "x", False), ("CUDA_DEVICE_MAX_CONNECTIONS", "32", True),
    ("CUDA_DEVICE_MAX_CONNECTIONS", "64", True)])
def test_the_switches_read_the_environment(monkeypatch, name, value, expected):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    read = gates.wanted if name == "FNPIPE_GATED_RECV" else gates.usable
    assert read() is expected


def test_the_queue_check_names_the_setting_that_fixes_it(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in gates.queues_short()
