"""Device and link profiles: the peak rates the cost model reads, with presets by name.

The preset numbers are datasheet leads, not measurements: NVIDIA H100 SXM5 (dense bf16 989 TFLOP/s,
FP32 non-tensor 67 TFLOP/s, FP64 tensor 67 TFLOP/s, HBM3 3.35 TB/s, 80 GB) and H200 SXM (the same
compute, HBM3e 4.8 TB/s, 141 GB); NVLink 4 moves 450 GB/s one direction. Real kernels reach about 70 %
of peak compute and 80 % of peak bandwidth, which the `*_efficiency` fields say. For numbers from the
real device, calibrate (engine.calibrate) and pass the result to the cost model.
"""
from __future__ import annotations

import os

import attrs
import torch

from ..errors import PlanError


@attrs.frozen
class DeviceProfile:
    """Peak rates of one accelerator (or one CPU socket): FLOP/s by dtype class, bytes/s, launch cost."""

    name: str
    matrix_flops_16: float      # bf16 / fp16 matrix ops (tensor cores)
    matrix_flops_32: float      # fp32 matrix ops (PyTorch's default: no TF32)
    flops_64: float             # fp64, matrix or not
    vector_flops: float         # everything else (elementwise, reductions), any dtype
    mem_bandwidth: float        # bytes/s of device memory
    launch_overhead: float      # seconds per launched op (kernel launch + framework dispatch)
    memory_bytes: int           # device memory a rank may fill
    compute_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.8
    kind: str = "cuda"          # the torch device type the model runs on

    def flops_for(self, dtype: torch.dtype, matrix: bool) -> float:
        """Achievable FLOP/s of an op of `dtype` (matrix op or not)."""
        if dtype == torch.float64:
            peak = self.flops_64
        elif not matrix:
            peak = self.vector_flops
        else:
            peak = self.matrix_flops_16 if dtype in (torch.bfloat16, torch.float16) else self.matrix_flops_32
        return peak * self.compute_efficiency

    @property
    def bandwidth(self) -> float:
        """Achievable bytes/s."""
        return self.mem_bandwidth * self.bandwidth_efficiency


@attrs.frozen
class LinkProfile:
    """A point-to-point link: bytes/s one direction and per-message latency."""

    name: str
    bandwidth: float
    latency: float

    def time(self, nbytes: int | float) -> float:
        """Seconds to move `nbytes` (zero bytes cost nothing: no message is sent)."""
        return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


H100 = DeviceProfile("h100", matrix_flops_16=989e12, matrix_flops_32=67e12, flops_64=67e12, vector_flops=67e12,
                     mem_bandwidth=3.35e12, launch_overhead=5e-6, memory_bytes=80 * 10**9)
H200 = attrs.evolve(H100, name="h200", mem_bandwidth=4.8e12, memory_bytes=141 * 10**9)
# A few-core x86 host without AMX: eager PyTorch on CPU, where dispatch costs ~10 us an op.
CPU = DeviceProfile("cpu", matrix_flops_16=50e9, matrix_flops_32=150e9, flops_64=75e9, vector_flops=20e9,
                    mem_bandwidth=20e9, launch_overhead=10e-6, memory_bytes=_host_memory(), kind="cpu")

DEVICES: dict[str, DeviceProfile] = {"h100": H100, "h200": H200, "cpu": CPU}

LINKS: dict[str, LinkProfile] = {
    "nvlink": LinkProfile("nvlink", 450e9, 5e-6),        # NVLink 4, H100/H200 SXM, one direction
    "pcie": LinkProfile("pcie", 25e9, 10e-6),            # PCIe 4 x16 as achieved
    "network": LinkProfile("network", 12.5e9, 20e-6),    # 100 Gb/s Ethernet / InfiniBand
    "loopback": LinkProfile("loopback", 2e9, 50e-6),     # gloo over TCP between processes of one host
}
DEFAULT_LINK = {"cuda": "nvlink", "cpu": "loopback"}


def _cuda_name() -> str:
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    return next((k for k in ("h200", "h100") if k in name), "h100")


def get_device(device: str | DeviceProfile) -> DeviceProfile:
    """A profile by preset name ("h100", "h200", "cpu"), or "cuda" for the GPU in this machine."""
    if isinstance(device, DeviceProfile):
        return device
    key = str(device).lower()
    if key.startswith("cuda"):
        key = _cuda_name()
    if key not in DEVICES:
        raise PlanError(f"unknown device '{device}'; use one of {sorted(DEVICES)} or 'cuda', "
                        "or pass an engine.DeviceProfile")
    return DEVICES[key]


def get_link(link: str | LinkProfile | None, device: DeviceProfile) -> LinkProfile:
    """A link by preset name; None gives the device's usual link (NVLink for GPUs, loopback for CPU)."""
    if isinstance(link, LinkProfile):
        return link
    key = DEFAULT_LINK.get(device.kind, "network") if link is None else str(link).lower()
    if key not in LINKS:
        raise PlanError(f"unknown link '{link}'; use one of {sorted(LINKS)} or pass an engine.LinkProfile")
    return LINKS[key]
