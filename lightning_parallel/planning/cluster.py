"""The hardware the analytic planner (:mod:`.analytic`) times a layout on: a device table, the node size, and where
each parallel axis sits on the mesh (so which bandwidth its collectives get). Pure Python.

Axes are laid out innermost first: tp, cp, dp (its HSDP shard group inside its replicas, ep the inner part of
dp), pp, as this package's mesh does. A group of ``size`` ranks ``stride`` apart stays inside one node when
``stride * size <= gpus_per_node`` and then gets the NVLink-class bandwidth; otherwise it crosses nodes, and the
rank gets its own share of the node's network (the node's bandwidth over its GPUs: one NIC per GPU on 8-GPU nodes
with 8 NICs) at the calibrated ``inter_link`` efficiency (:mod:`.timemodel`), whatever the stride: a flat data
parallel group of consecutive ranks gets no more than one behind tp=8 (the published ZeRO-3 runs across a thousand
GPUs ran at that rate, :mod:`.calibrate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from lightning_parallel.planning.timemodel import CALIBRATION, INTRA_LINK, Calibration

# nominal figures; COMM_EFFICIENCY turns link bandwidth into what collectives achieve (NCCL's bus bandwidth)
COMM_EFFICIENCY = INTRA_LINK


@dataclass(frozen=True)
class Device:
    """One accelerator and its node's links.

    Attributes:
        name: the ``--device`` value.
        peak_flops: dense bf16/fp16 FLOP/s (no sparsity).
        memory: bytes of device memory.
        hbm_bandwidth: bytes/s of device memory (what memory-bound kernels run at).
        intra_node_bw: bytes/s one device sends to others in its node (one direction).
        inter_node_bw: bytes/s a whole node sends to others (all its NICs, one direction).
        gemm_efficiency: the fraction of ``peak_flops`` large matrix multiplies sustain.
        attention_efficiency: the fraction fused (flash) attention kernels sustain, forward and backward together.
        intra_latency, inter_latency: seconds per step of a collective inside a node and across nodes.
        fp8_flops: dense fp8 FLOP/s (no sparsity); 0: the device has no fp8 matrix multiplies
            (``precision=fp8`` is refused on it, :func:`.fp8.check_fp8_device`).
    """

    name: str
    peak_flops: float
    memory: float
    hbm_bandwidth: float
    intra_node_bw: float
    inter_node_bw: float
    gemm_efficiency: float = 0.75
    attention_efficiency: float = 0.5
    intra_latency: float = 3e-6
    inter_latency: float = 10e-6
    fp8_flops: float = 0.0


GIB = 2**30
# dense peaks, the vendors' datasheets (their "with sparsity" figures halved): A100 SXM bf16 312 TFLOP/s, no fp8
# (compute capability 8.0); H100 SXM bf16 989.4, fp8 1,978.9 (3,958 sparse); H200 SXM the same tensor cores as
# H100 SXM, bf16 989.4, fp8 1,978.9; MI300X bf16 1,307.4, fp8 2,614.9 (5,229.8 sparse; e4m3fnuz, which torchao
# picks on MI300).
DEVICES = {
    d.name: d
    for d in (
        Device("a100-40gb", 312e12, 40 * GIB, 1.555e12, 300e9, 200e9, 0.75, 0.55),  # NVLink3, 8 x HDR 200 Gb/s
        Device("a100-80gb", 312e12, 80 * GIB, 2.039e12, 300e9, 200e9, 0.75, 0.55),
        # NVLink4, 8 x NDR 400 Gb/s
        Device("h100", 989e12, 80 * GIB, 3.35e12, 450e9, 400e9, 0.7, 0.35, fp8_flops=1979e12),
        Device("h200", 989e12, 141e9, 4.8e12, 450e9, 400e9, 0.7, 0.35, fp8_flops=1979e12),
        # Infinity Fabric, 8 x 400 Gb/s
        Device("mi300x", 1307e12, 192e9, 5.3e12, 448e9, 400e9, 0.55, 0.35, fp8_flops=2615e12),
    )
}


def get_device(name: str, **overrides: float | None) -> Device:
    """A row of :data:`DEVICES`, with any non-None field of ``overrides`` replacing the table's figure."""
    if name not in DEVICES:
        raise ValueError(f"--device={name!r} is unknown: use one of {', '.join(DEVICES)} (and override figures).")
    return replace(DEVICES[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices, ``gpus_per_node`` to a node.

    Attributes:
        gpus: the world size.
        gpus_per_node: devices sharing one node's fast interconnect.
        device: their :class:`Device`.
        calibration: the time model's fitted constants (:data:`.timemodel.CALIBRATION`).
    """

    gpus: int
    gpus_per_node: int
    device: Device
    calibration: Calibration = field(default=CALIBRATION)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--gpus={self.gpus} and --gpus-per-node={self.gpus_per_node} must be at least 1.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"--gpus={self.gpus} is not a whole number of nodes of {self.gpus_per_node}: give a multiple."
            )

    def bandwidth(self, stride: int, size: int) -> float:
        """Bytes/s each rank of a group of ``size`` ranks ``stride`` apart achieves in a collective."""
        d = self.device
        if stride * size <= self.gpus_per_node:
            return d.intra_node_bw * COMM_EFFICIENCY
        return min(d.intra_node_bw, d.inter_node_bw / self.gpus_per_node) * self.calibration.inter_link

    def efficiency(self, kind: str = "gemm") -> float:
        """The fraction of peak FLOP/s large GEMMs (``gemm``) or fused attention (``attention``) achieve: the
        device table's figure times the calibrated ``compute`` scale."""
        d = self.device
        return (d.gemm_efficiency if kind == "gemm" else d.attention_efficiency) * self.calibration.compute

    def latency(self, stride: int, size: int) -> float:
        d = self.device
        return d.intra_latency if stride * size <= self.gpus_per_node else d.inter_latency

    def all_reduce_time(self, payload: float, stride: int, size: int, count: int = 1) -> float:
        """Seconds of ``count`` all-reduces of ``payload`` bytes in all: 2 (n-1)/n of it through each rank, and
        2 log2(n) latency steps each (NCCL's trees at scale)."""
        if size == 1:
            return 0.0
        steps = 2 * math.ceil(math.log2(size)) * count
        return 2 * payload * (size - 1) / size / self.bandwidth(stride, size) + steps * self.latency(stride, size)

    def gather_time(self, payload: float, stride: int, size: int, count: int = 1) -> float:
        """Seconds of ``count`` all-gathers, reduce-scatters or all-to-alls of ``payload`` bytes in all (whole
        tensors): (n-1)/n of it through each rank, n-1 ring steps each."""
        if size == 1:
            return 0.0
        steps = (size - 1) * count
        return payload * (size - 1) / size / self.bandwidth(stride, size) + steps * self.latency(stride, size)
