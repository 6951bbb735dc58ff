"""The experts of a MoE layer: E FFNs as stacked weights, run over rows grouped by expert. Pure torch.

Two kernels compute the same math (:func:`expert_forward`):

- **grouped** (the default on CUDA in bf16): ``torch.nn.functional.grouped_mm`` with the offsets as a device tensor,
  so nothing waits for the host and nothing is padded. On CUDA its CUTLASS kernel takes bf16 on sm90/sm100; other
  dtypes and devices run torch's fallback (a loop of matmuls, which reads the offsets on the host itself), and
  torch.compile traces it in bf16 only. It takes fp32, fp16 and bf16 whose rows are multiples of 16 bytes, on CPU
  too, which is how the tests compare it with its twin.
- **padded** (the default otherwise): each expert's rows padded to the largest count and one batched matmul over
  the experts: E_local x max_load x d, and one host read of the largest count unless the caller has it.

Initial values are drawn on the host, one expert after the other: under expert parallelism each rank keeps only its
experts' draws (one expert's worth of host memory) and still gets the values one process gets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.parallel.dtensor import local

GROUPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what grouped_mm takes in torch 2.13
# torch 2.11 and 2.13 have F.grouped_mm; without it the padded twin runs (fused=None) or fused=True says why
GROUPED_MM_MISSING = None if hasattr(F, "grouped_mm") else f"torch {torch.__version__} has no F.grouped_mm"
NORMAL_BLOCK = 16  # torch's host normal_ draws 16 values at a time (the last 16 again when the size is not a multiple)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's on ``x``'s device when it is on, else ``x``'s."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def grouped_mm_fits(dtype: torch.dtype, w1: Tensor) -> bool:
    """True when ``grouped_mm`` takes experts ``w1`` (E, d, f) in ``dtype``: a dtype it has and rows of d and f
    elements that are multiples of 16 bytes."""
    if dtype not in GROUPED_DTYPES:
        return False
    align = 16 // dtype.itemsize
    return w1.shape[-2] % align == 0 and w1.shape[-1] % align == 0


def grouped_by_default(device: torch.device, dtype: torch.dtype, w1: Tensor) -> bool:
    """``fused=None``'s choice: the grouped GEMM on CUDA for bf16 compute (the dtype of CUDA's fast kernel, and the
    only one torch.compile traces grouped_mm in) where it fits, the padded twin otherwise."""
    fits = device.type == "cuda" and dtype == torch.bfloat16 and grouped_mm_fits(dtype, w1)
    return fits and GROUPED_MM_MISSING is None


def expert_forward(
    x: Tensor,
    counts: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor | None = None,
    activation: str = "gelu",
    fused: bool | None = None,
    max_count: int | None = None,
) -> Tensor:
    """Rows grouped by expert through their experts' FFNs: ``gelu(x W1_e) W2_e``, or for SwiGLU
    ``(silu(x W1_e) * x W3_e) W2_e``.

    Args:
        x: (M, d) rows, expert 0's first, then expert 1's, ...
        counts: (E,) integer rows per expert, on ``x``'s device, summing to M.
        w1, w3: (E, d, f) plain tensors (a DTensor's local shard); ``w3`` only for ``swiglu``.
        w2: (E, f, d).
        activation: ``gelu`` or ``swiglu``.
        fused: True: the grouped GEMM (device offsets, no host sync; fp32 and fp16 too in eager mode, bf16 only
            under torch.compile); False: the padded batched matmul (its math twin); None: :func:`grouped_by_default`
            (grouped on CUDA for bf16 compute, as under bf16-true and bf16-mixed; padded otherwise).
        max_count: the largest count when the caller already holds it on the host (spares the padded kernel its
            one host sync); the grouped kernel ignores it.

    Returns:
        (M, d) in the compute dtype (autocast's when it is on, else ``x``'s).
    """
    if activation not in ("gelu", "swiglu") or (activation == "swiglu") != (w3 is not None):
        raise ValueError(f"activation={activation!r} with w3 {'given' if w3 is not None else 'missing'}: use gelu "
                         "without w3, or swiglu with w3 (E, d, f).")  # fmt: skip
    dtype = compute_dtype(x)
    if fused is None:
        fused = grouped_by_default(x.device, dtype, w1)
    if fused and GROUPED_MM_MISSING:
        raise RuntimeError(f"expert_forward(fused=True): {GROUPED_MM_MISSING} (torch 2.11 and 2.13 have it). "
                           "Use fused=None or False: the padded batched matmul, the same math.")  # fmt: skip
    if fused:
        return _grouped(x, counts, w1, w2, w3, dtype)
    return _padded(x, counts, w1, w2, w3, max_count)


def _grouped(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, dtype: torch.dtype) -> Tensor:
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # stays on the device: grouped_mm reads it there

    def mm(rows: Tensor, w: Tensor) -> Tensor:  # grouped_mm has no autocast rule: the casts are explicit
        return F.grouped_mm(_aligned(rows), _aligned(w.to(dtype)), offs=offsets)

    x = x.to(dtype)
    h = mm(x, w1)
    h = F.silu(h) * mm(x, w3) if w3 is not None else F.gelu(h)
    return _DenseGrad.apply(mm(h, w2))


class _DenseGrad(torch.autograd.Function):
    """The identity, whose backward hands on a dense gradient: grouped_mm's backward (torch 2.13) refuses an
    expanded one, such as a sum's."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _padded(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, max_count: int | None) -> Tensor:
    rows, experts = x.shape[0], w1.shape[0]
    which = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=rows)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows, device=x.device) - starts[which]
    if max_count is None:  # the padded width: this kernel's one host sync (0 rows: the weights still get 0 grads)
        max_count = int(counts.max()) if counts.numel() else 0
    padded = x.new_zeros(experts, max_count, x.shape[-1]).index_put((which, slot), x)
    h = torch.bmm(padded, w1.to(x.dtype))
    h = F.silu(h) * torch.bmm(padded, w3.to(x.dtype)) if w3 is not None else F.gelu(h)
    return torch.bmm(h, w2.to(x.dtype))[which, slot]


def _aligned(t: Tensor) -> Tensor:
    """``t`` contiguous at a 16-byte address (grouped_mm's requirement; views into a flat buffer may miss it).
    Traced by torch.compile, there is no address to read: the compiler lays out its own buffers."""
    t = t.contiguous()
    return t if torch.compiler.is_compiling() or t.data_ptr() % 16 == 0 else t.clone()


class GroupedExperts(nn.Module):
    """E FFNs as stacked weights ``w1`` (E, d, f), ``w2`` (E, f, d) (and ``w3`` (E, d, f) for SwiGLU).

    Under expert parallelism the weights are DTensors sharded on dim 0 and this rank computes its E/ep experts.
    ``fused`` picks the kernel (:func:`expert_forward`; None: by device).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, activation: str = "gelu") -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden, self.activation = num_experts, dim, hidden, activation
        self.fused: bool | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden)) if activation == "swiglu" else None
        if not self.w1.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(
        self, generator: torch.Generator | None = None, std: float = 0.02, out_std: float | None = None
    ) -> None:
        """N(0, std) inputs, N(0, out_std) outputs (GPT-2's scaled residual init), drawn on the host in the order
        w1, w3, w2, each expert after the other; this rank keeps its experts' values."""
        for name, weight in (("w1", self.w1), ("w3", self.w3), ("w2", self.w2)):
            if weight is not None:
                sigma = (out_std if out_std is not None else std) if name == "w2" else std
                _draw_experts(weight, sigma, generator)

    def forward(self, rows: Tensor, counts: Tensor, max_count: int | None = None) -> Tensor:
        """``rows`` grouped by this rank's experts (``counts`` per expert, in order) through their FFNs. Called as
        a module (ZeRO-3 gathers the weights in its forward hooks)."""
        w3 = local(self.w3) if self.w3 is not None else None
        return expert_forward(rows, counts, local(self.w1), local(self.w2), w3, self.activation, self.fused, max_count)


def _draw_experts(param: Tensor, sigma: float, generator: torch.Generator | None) -> None:
    shard = local(param)
    start = _first_local_expert(param)
    shard.copy_(draw_experts(param.shape, start, start + shard.shape[0], sigma, generator))


def draw_experts(
    shape: torch.Size, start: int, stop: int, sigma: float, generator: torch.Generator | None = None
) -> Tensor:
    """Experts ``start:stop`` of ``torch.randn(shape, generator=generator) * sigma`` (shape (E, ...)), on the host,
    with the generator left where that whole draw leaves it, holding one expert's values at a time.

    torch fills host normals 16 at a time (the last 16 redrawn when the size is not a multiple of 16), so drawing
    expert after expert gives the whole draw's values when an expert's size is a multiple of 16; otherwise the
    whole tensor is drawn, as it always was."""
    per_expert = torch.Size(shape[1:])
    if per_expert.numel() % NORMAL_BLOCK:
        return torch.randn(shape, generator=generator)[start:stop] * sigma
    out = torch.empty((stop - start, *per_expert))
    scratch = torch.empty(per_expert)
    for expert in range(shape[0]):
        torch.randn(per_expert, generator=generator, out=scratch)  # the other experts' draws only advance the RNG
        if start <= expert < stop:
            torch.mul(scratch, sigma, out=out[expert - start])
    return out


def _first_local_expert(param: Tensor) -> int:
    """The global index of the first expert this rank holds of ``param`` (0 unless expert-parallel)."""
    rows = local(param).shape[0]
    if rows == param.shape[0]:
        return 0
    assert isinstance(param, DTensor)
    return param.device_mesh.get_local_rank() * rows
