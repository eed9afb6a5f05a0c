"""Fault and hostile-input cases, run under mpirun at 2 ranks (tests/faults/test_faults.py launches them).

    mpirun -n 2 python tests/faults/cases.py healthy        # every case that must leave the job healthy
    mpirun -n 2 python tests/faults/cases.py hang|exit|raise|kill   # one rank misbehaves; the job must end

`healthy` prints `CASE <name> rank <r> <outcome>` per case; the others print what each rank saw before the
job ended. Each case is small: a float64 MLP of three 16 x 16 layers, 4 microbatches.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402
import schedules  # noqa: E402

TIMEOUT = 8.0


def mlp(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for w in params["layers"]:
        h = torch.tanh(h @ w)
    return ((h - y) ** 2).mean()


def data() -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # the same on every rank
    params = {"layers": [torch.randn(16, 16, dtype=torch.float64) / 4 for _ in range(3)]}
    return params, torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)


def report(name: str, outcome: str) -> None:
    print(f"CASE {name} rank {engine.init().rank} {outcome}", flush=True)


def expect_error(name: str, run: Callable[[], Any]) -> None:
    began = time.perf_counter()
    try:
        run()
    except Exception as exc:  # noqa: BLE001 -- the case's outcome is the error
        report(name, f"{type(exc).__name__} in {time.perf_counter() - began:.1f} s: {str(exc).splitlines()[0]}")
        return
    report(name, "no error")


def short_schedule() -> None:
    schedules.register("short", lambda n, m, **o: schedules.get("gpipe")(n, m - 1, **o))
    params, x, y = data()
    expect_error("short-table", lambda: engine.parallelize(mlp, params, x, y, schedule="short", microbatches=4))


def bad_timeouts() -> None:
    params, x, y = data()
    for t in (0, -1.0, math.inf, math.nan, "60"):
        expect_error(f"timeout={t}", lambda t=t: engine.parallelize(mlp, params, x, y, microbatches=4, timeout=t))


def resources() -> None:
    params, x, y = data()

    def held() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    before = None
    for k in range(22):
        if k == 2:
            before = held()  # after the first steps: caches and the world's group are made once
        with engine.parallelize(mlp, params, x, y, microbatches=4, timeout=TIMEOUT) as step:
            step(step.shard(params), x, y)
    after = held()
    assert before is not None
    report("20-parallelize", f"fds {before[0]} -> {after[0]}, threads {before[1]} -> {after[1]}")


def _listening(pid: int) -> set[str]:
    """Addresses this process listens on (from /proc/net/tcp{,6} and its socket inodes)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.islink(f"/proc/{pid}/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                if family == socket.AF_INET:
                    ip = socket.inet_ntop(family, raw[::-1])
                else:
                    ip = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                out.add(f"{ip}:{int(port, 16)}")
    return out


def loopback(listening_before: set[str]) -> None:
    params, x, y = data()
    with engine.parallelize(mlp, params, x, y, microbatches=4, timeout=TIMEOUT) as step:
        step(step.shard(params), x, y)
        new = sorted(_listening(os.getpid()) - listening_before)
    outside = [a for a in new if not a.startswith(("127.", "::1", "::ffff:127."))]
    report("loopback-only", f"new listeners {len(new)}, outside loopback {outside}")


def no_unpickling() -> None:
    """Everything that crosses between ranks in a step, a traced step, a report and a checkpoint."""
    import torch.distributed.distributed_c10d as c10d

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("unpickled data from another process")

    saved = (pickle.loads, pickle.Unpickler, c10d._tensor_to_object)
    pickle.loads, pickle.Unpickler, c10d._tensor_to_object = refuse, refuse, refuse  # type: ignore[assignment]
    try:
        params, x, y = data()
        with engine.parallelize(mlp, params, x, y, microbatches=4, timeout=TIMEOUT) as step:
            local = step.shard(params)
            step(local, x, y)
            _, _, spans = step.traced(local, x, y)
            every, _ = engine.report.gather(step, spans)
            from engine.execution.transport import broadcast_json

            where = Path(broadcast_json(tempfile.mkdtemp(prefix="fnpipe-faults-"))) / "ckpt"
            engine.checkpoint.save(where, step, local)
            loaded, _ = engine.checkpoint.load(where, step, params)
            assert all(torch.equal(a, b) for a, b in zip(loaded["layers"], local["layers"]) if a is not None)
        report("no-unpickling", f"ok, {len(every)} spans gathered")
    finally:
        pickle.loads, pickle.Unpickler, c10d._tensor_to_object = saved


def leaves() -> None:
    params, x, y = data()
    params = {**params, "unused": torch.ones(3, dtype=torch.float64), "ids": torch.arange(4), "flag": torch.tensor(True)}
    with engine.parallelize(mlp, params, x, y, microbatches=4, timeout=TIMEOUT) as step:
        _, grads = step(step.shard(params), x, y)
    kinds = {k: None if grads[k] is None else float(grads[k].abs().sum()) for k in ("unused", "ids", "flag")}
    report("leaves", json.dumps(kinds, sort_keys=True))


def corrupt_cache() -> None:
    from engine.execution.transport import broadcast_json

    params, x, y = data()
    path = Path(broadcast_json(tempfile.mkdtemp(prefix="fnpipe-faults-"))) / "deploy.json"
    if engine.init().rank == 0:
        path.write_text('{"format": "fnpipe-plan/3", "key": {"world_size": 2}, "plan": {"schedule": 5}')
    torch.distributed.barrier()
    expect_error("corrupt-plan-cache", lambda: engine.parallelize(mlp, params, x, y, microbatches=4,
                                                                  plan_cache=path, timeout=TIMEOUT))
    torch.distributed.barrier()


def healthy() -> None:
    from mpi4py import MPI  # noqa: F401 -- MPI's own listeners (its TCP transport) come before fnpipe's

    before = _listening(os.getpid())
    engine.init(TIMEOUT)
    for case in (short_schedule, bad_timeouts, resources, lambda: loopback(before), no_unpickling, leaves,
                 corrupt_cache):
        case()
    print(f"DONE rank {engine.init().rank}", flush=True)


def misbehave(how: str) -> None:
    """Rank 1 misbehaves in step 2 of a training loop; rank 0 must notice, and the job must end."""
    params, x, y = data()
    step = engine.parallelize(mlp, params, x, y, microbatches=4, timeout=TIMEOUT)
    local = step.shard(params)
    for k in range(4):
        if step.world.rank == 1 and k == 2:
            print(f"rank 1 misbehaves: {how}", flush=True)
            if how == "hang":
                time.sleep(3600)
            elif how == "exit":
                os._exit(0)
            elif how == "raise":
                raise ValueError("an error of rank 1's own")
            elif how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        step(local, x, y)
        print(f"rank {step.world.rank} step {k}", flush=True)


if __name__ == "__main__":
    which = sys.argv[1]
    healthy() if which == "healthy" else misbehave(which)
