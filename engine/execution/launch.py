"""Bootstrap: join the ranks started by mpirun, torchrun or plain python, and pick the device."""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import sys

import attrs
import torch
import torch.distributed as dist

log = logging.getLogger("engine.launch")
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


@attrs.frozen
class World:
    """Who this process is: rank, world size, local rank, device, and whether torch.distributed is up."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    distributed: bool


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _init_from_mpi(timeout: datetime.timedelta) -> tuple[int, int, int]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    if size == 1:
        return 0, 1, 0
    store = None
    if rank == 0:  # rank 0 binds port 0 (the OS picks a free one) and tells the others through MPI
        host = socket.gethostbyname(socket.gethostname()) if os.environ.get("FNPIPE_MULTIHOST") else "127.0.0.1"
        store = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        addr = (host, store.port)
    else:
        addr = None
    host, port = comm.bcast(addr, root=0)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    _init_pg(store=store, rank=rank, size=size, local=local, timeout=timeout)
    return rank, size, local


def _init_pg(*, store, rank: int, size: int, local: int, timeout: datetime.timedelta) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs: dict = {"device_id": _device(local)} if backend == "nccl" else {}
    if store is None:
        kwargs["init_method"] = "env://"
    else:
        kwargs["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
    atexit.register(_shutdown)


def _shutdown() -> None:
    """Tear down the process group fnpipe made while Python is still whole: gloo's worker threads
    otherwise drop their last tensors during interpreter finalisation and abort the process."""
    if getattr(sys, "last_value", None) is not None:
        return  # the program died of an exception (maybe a dead peer): tearing down could wait on it
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 -- at exit a peer may be gone; nothing left to do
            log.debug("destroy_process_group at exit: %s", exc)


def init(timeout: float = 60.0) -> World:
    """Join the job: an existing process group, torchrun's env, mpirun's, or run alone."""
    td = datetime.timedelta(seconds=timeout)
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if size > 1:  # env:// joins torchrun's own store (TORCHELASTIC_USE_AGENT_STORE) correctly
            _init_pg(store=None, rank=rank, size=size, local=local, timeout=td)
    elif any(k in os.environ for k in MPI_ENV):
        rank, size, local = _init_from_mpi(td)
    else:
        rank, size, local = 0, 1, 0
    world = World(rank, size, local, _device(local), size > 1)
    log.info("rank %d of %d (local %d) on %s", rank, size, local, world.device)
    return world
