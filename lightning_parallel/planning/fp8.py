"""FP8 training (torchao's float8 linears over a ``bf16-mixed`` autocast) in the analytic planner. Pure Python.

What ``precision="fp8"`` changes in a plan:

- Which matmuls run in fp8: the linears torchao converts, the attention projections and the dense (and
  shared-expert) MLP linears whose both dimensions are multiples of 16 (:func:`converted`). Kept in bf16 by name:
  the embeddings, the output head, the routers, and the attention core (softmax(QK^T)V is no linear). The routed
  experts' grouped multiply runs in fp8 where the runtime gives it torchao's float8 grouped GEMM (CUDA compute
  capability 9.0 and up: :data:`FP8_GROUPED_DEVICES`, ``parallel/float8_experts.py``) and their dimensions are
  multiples of 16, in bf16 elsewhere (:func:`experts_in_fp8`); their weights are never gathered in fp8. A converted
  linear's three matmuls (forward, input gradient, weight gradient) run at the device's fp8 peak
  (:attr:`.cluster.Device.fp8_flops`) times the same large-GEMM efficiency as bf16's; the rest at the bf16 peak.
  The casts to fp8 are memory traffic: each converted linear's input read for its amax, read again and written in
  1 byte (:data:`CAST_BYTES`), the backward's casts (output gradients, transposes) twice that, at HBM bandwidth.
- The share of the FLOPs that run in fp8 (:func:`fp8_flop_share`): the converted linears' FLOPs over the FLOPs
  MFU counts (6 N per token and causal attention, the head included).
- ZeRO-3 with ``fsdp_float8_all_gather``: the converted linears' weights are all-gathered as 1-byte fp8 elements,
  the kept ones in bf16 (2 bytes); each converted weight's scale comes from an all-reduce of its fp32 amax (4
  bytes) per gather (:func:`gather_payload`). Without it, every weight is gathered in bf16, as ``bf16-mixed``.
- Memory: as ``bf16-mixed`` (fp32 master weights, gradients and optimizer states; torchao's float8 linears keep
  their bf16 input and weight for backward and cast again there).
"""

from __future__ import annotations

from lightning_parallel.planning.cluster import Device
from lightning_parallel.planning.hf_config import ModelShape
from lightning_parallel.planning.matrices import Matrix, stage_matrices

FP8 = "fp8"
FP8_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each operand divisible by 16
CONVERTED_KINDS = ("attention", "mlp")  # the Float8Linear layers (their weights gathered in fp8 with float8 all-gather)
# devices whose routed experts multiply in fp8 (torchao's float8 grouped GEMM: CUDA, compute capability 9.0 and up)
FP8_GROUPED_DEVICES = frozenset({"h100", "h200"})
AMAX_BYTES = 4  # one fp32 amax per converted weight, all-reduced before each fp8 all-gather
CAST_BYTES = 5  # HBM bytes per element of a converted linear's input, forward: amax read (2), cast read (2), write (1)


def converted(m: Matrix) -> bool:
    """Whether torchao's float8 conversion takes this linear (as the FP8 module filter does)."""
    return m.kind in CONVERTED_KINDS and _fits(m)


def experts_in_fp8(device: Device | None) -> bool:
    """Whether the routed experts' grouped multiply runs in fp8 on ``device`` (None: unknown, bf16)."""
    return device is not None and device.name in FP8_GROUPED_DEVICES


def converted_kinds(shape: ModelShape, device: Device | None = None) -> frozenset[str]:
    """The kinds (``attention``, ``mlp``; ``expert`` where :func:`experts_in_fp8` on ``device``) whose every matmul
    runs in fp8 (both dimensions multiples of 16)."""
    every = stage_matrices(shape, 1, 1)
    kinds = CONVERTED_KINDS + (("expert",) if experts_in_fp8(device) else ())
    return frozenset(k for k in kinds if all(_fits(m) for m, _ in every if m.kind == k and m.numel))


def _fits(m: Matrix) -> bool:
    return m.rows % FP8_MULTIPLE == 0 and m.cols % FP8_MULTIPLE == 0


def converted_params(shape: ModelShape, dense: int, moe: int) -> tuple[int, int]:
    """(elements, tensors) of the converted linears' weights in ``dense`` dense and ``moe`` MoE layers."""
    held = [(m, n) for m, n in stage_matrices(shape, dense, moe) if converted(m) and m.numel]
    return sum(m.numel * n for m, n in held), sum(n for _, n in held)


def fp8_flop_share(shape: ModelShape, seq_len: int, device: Device | None = None) -> float:
    """The fraction of the FLOPs MFU counts (per token: 2 x the active parameters, the head's included, and causal
    attention) that run in fp8 on ``device`` (:func:`converted_kinds`; a token's routed experts: top-k of them):
    the same for forward and backward."""
    kinds = converted_kinds(shape, device)
    every = stage_matrices(shape, shape.dense_layers_count(), shape.moe_layers)
    fp8 = sum(2 * m.rows * m.cols * (shape.top_k if m.kind == "expert" else m.count) * n
              for m, n in every if m.kind in kinds)  # fmt: skip
    attention = seq_len * shape.heads * (shape.qk_head_dim + shape.v_head_dim) * shape.layers  # causal: half
    return fp8 / (2 * shape.active_params() + attention)


def gather_payload(held: float, fp8_held: float, float8_all_gather: bool) -> float:
    """Bytes of one ZeRO-3 all-gather of a rank's ``held`` parameters (before sharding) under ``fp8``: the
    ``fp8_held`` elements of converted weights in 1 byte and the rest in bf16 with ``float8_all_gather``
    (``fsdp_float8_all_gather``), all in bf16 without it. The amaxes' all-reduce (:data:`AMAX_BYTES` per converted
    tensor) is not in it: see :func:`amax_bytes`."""
    if not float8_all_gather:
        return 2.0 * held
    return 1.0 * fp8_held + 2.0 * (held - fp8_held)


def amax_bytes(fp8_tensors: float, world: int) -> float:
    """Bytes one rank sends in the amax all-reduces of one fp8 all-gather (ring: 2 (w-1)/w of 4 bytes a tensor)."""
    return 2 * AMAX_BYTES * fp8_tensors * (world - 1) / world if world > 1 else 0.0


def check_fp8_device(device: Device, precision: str) -> None:
    """Refuse ``precision=fp8`` on a device without fp8 matmuls (an A100: compute capability 8.0)."""
    if precision == FP8 and not device.fp8_flops:
        raise ValueError(
            f"precision=fp8 needs fp8 matrix multiplies (compute capability 8.9 or newer), and {device.name} has "
            "none: plan bf16-mixed on it, or pick a device with fp8 (--device h100, h200 or mi300x)."
        )
