"""One block of ring attention: its output and log-sum-exp, and its gradients given the merged row. Pure torch.

Ring attention needs, per block of keys, the block's output and the log-sum-exp (LSE) of its score rows, so that
blocks merge exactly (:mod:`.ring`), and a backward that takes the *merged* output and LSE of the rows (flash
attention's backward: probabilities exp(s - lse) and rowsum(dO * O) of the whole row, so blocks' gradients add up).
torch's fused kernels that return the LSE are used where they run, chosen by device (:func:`kernel_for`):

====================  =========================================================  ====================================
kernel                op                                                         computes in
====================  =========================================================  ====================================
``cpu_flash``         ``aten._scaled_dot_product_flash_attention_for_cpu``       fp32 (or wider): CPU is the test bed
``cuda_flash``        ``aten._scaled_dot_product_flash_attention``               the input dtype (bf16, fp16)
``cuda_efficient``    ``aten._scaled_dot_product_efficient_attention``           the input dtype (bf16, fp16, fp32)
``math``              unfused matmuls, query rows in slices (the twin)           fp32 (or wider), autocast off
====================  =========================================================  ====================================

``math`` is the reference every kernel is checked against (same arguments, same (out, lse) layout) and runs
wherever no fused kernel does (another device, fp64 on CUDA, an unsupported head size). Its score blocks are cut
into query-row slices of at most ``MATH_SCORES`` elements, so it never holds a whole (B, H, Tq, Tk) block.
``causal`` masks top-left aligned (query row i sees keys 0..i), as ``is_causal`` does; the ring only asks it of
square blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

aten = torch.ops.aten
KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "math")
MATH_SCORES = 1 << 24  # score elements per slice of the math twin: 64 MiB of fp32 scores at most
_NO_RNG = torch.empty((), dtype=torch.long)  # the philox seed and offset the CUDA kernels return without dropout


def pick_kernel(device_type: str, flash: bool, efficient: bool) -> str:
    """The block kernel for tensors on ``device_type``, ``flash`` / ``efficient`` saying whether torch's CUDA flash
    and memory-efficient kernels accept them (their dtype, head size, GPU, ``sdpa_kernel`` settings)."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type == "cuda" and flash:
        return "cuda_flash"
    if device_type == "cuda" and efficient:
        return "cuda_efficient"
    return "math"


def kernel_for(q: Tensor, k: Tensor | None = None, v: Tensor | None = None) -> str:
    """The block kernel for these queries, keys and values (``k``, ``v`` default to ``q``): see :func:`pick_kernel`.
    On CUDA, torch's own checks decide (``can_use_flash_attention`` / ``can_use_efficient_attention``), so an
    ``sdpa_kernel`` context that rules a kernel out rules it out here too."""
    if q.device.type != "cuda":
        return pick_kernel(q.device.type, False, False)
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    params = SDPAParams(q, q if k is None else k, q if v is None else v, None, 0.0, True, False)
    return pick_kernel("cuda", can_use_flash_attention(params), can_use_efficient_attention(params))


def compute_dtype(kernel: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``kernel`` computes a block in: the input's for the CUDA kernels, else fp32 or the input's if
    wider."""
    return dtype if kernel.startswith("cuda_") else torch.promote_types(dtype, torch.float32)


def _prepare(kernel: str | None, q: Tensor, *tensors: Tensor) -> tuple[str, list[Tensor]]:
    kernel = kernel or kernel_for(q, *tensors[:2])
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: choose one of {KERNELS}, or None to pick by device")
    dtype = compute_dtype(kernel, q.dtype)
    return kernel, [t.to(dtype).contiguous() for t in (q, *tensors)]


def block_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, kernel: str | None = None
) -> tuple[Tensor, Tensor]:
    """One block's attention output and the log-sum-exp of its score rows.

    Args:
        q: (B, H, Tq, D) queries; k, v: (B, H, Tk, D) keys and values (any dtype, cast to the kernel's).
        causal: query row i sees keys 0..i (top-left aligned); else every key.
        scale: the score scale.
        kernel: one of ``KERNELS``; None picks by device (:func:`kernel_for`).

    Returns:
        out (B, H, Tq, D) in the kernel's compute dtype (:func:`compute_dtype`) and lse (B, H, Tq) in fp32 (fp64
        for fp64 inputs on CPU and math), natural log.
    """
    kernel, (q, k, v) = _prepare(kernel, q, k, v)
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "cuda_flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    if kernel == "cuda_efficient":
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[-2]]  # the kernel pads the LSE's rows to a multiple of 32
    return _math_forward(q, k, v, causal, scale)


def block_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    kernel: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block, given the *merged* output and log-sum-exp of its query rows (over every block the
    rows see), so that the blocks' gradients add up to the whole row's.

    Args:
        dout, out: (B, H, Tq, D) the output's gradient and the merged output (cast to the kernel's dtype).
        q, k, v, causal, scale, kernel: as :func:`block_attention`.
        lse: (B, H, Tq) the merged log-sum-exp (fp32, or fp64 for fp64 inputs).

    Returns:
        dq (B, H, Tq, D), dk and dv (B, H, Tk, D), in the kernel's compute dtype (any strides).
    """
    kernel, (q, k, v, dout, out) = _prepare(kernel, q, k, v, dout, out)
    lse = lse.contiguous()
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    tq, tk = q.shape[-2], k.shape[-2]
    if kernel == "cuda_flash":  # no varlen (cum_seq None), no dropout (philox unused)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, tq, tk, 0.0, causal, _NO_RNG, _NO_RNG, scale=scale
        )
    if kernel == "cuda_efficient":
        lse = F.pad(lse, (0, 0 if torch.version.hip else -tq % 32))  # as the forward kernel lays it out
        needs = [True, True, True, False]  # dq, dk, dv; no bias
        grads = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, _NO_RNG, _NO_RNG, 0.0, needs, causal, scale=scale
        )
        return grads[0], grads[1], grads[2]
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


def _row_slices(q: Tensor, tk: int) -> list[slice]:
    """Query-row slices whose (B, H, rows, Tk) scores hold at most ``MATH_SCORES`` elements."""
    rows = max(1, MATH_SCORES // max(1, q.shape[0] * q.shape[1] * tk))
    return [slice(start, start + rows) for start in range(0, q.shape[-2], rows)]


def _scores(q: Tensor, k: Tensor, rows: slice, causal: bool, scale: float) -> Tensor:
    """(B, H, rows, Tk) scaled scores of query rows ``rows``, -inf where causal hides a key."""
    scores = torch.matmul(q[..., rows, :], k.transpose(-2, -1)) * scale
    if causal:
        row = torch.arange(rows.start, rows.start + scores.shape[-2], device=q.device).unsqueeze(-1)
        scores = scores.masked_fill(torch.arange(k.shape[-2], device=q.device) > row, float("-inf"))
    return scores


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """The unfused twin of the flash kernels' forward, a slice of query rows at a time. Differentiable through
    autograd as they are: the output is, the log-sum-exp is not (torch declares theirs non-differentiable)."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:-1])
    with torch.autocast(q.device.type, enabled=False):
        for rows in _row_slices(q, k.shape[-2]):
            scores = _scores(q, k, rows, causal, scale)
            lse[..., rows] = torch.logsumexp(scores, dim=-1)
            out[..., rows, :] = torch.matmul(torch.exp(scores - lse[..., rows].unsqueeze(-1)), v)
    return out, lse.detach()


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The unfused twin of the flash kernels' backward: probabilities exp(s - lse) from the merged row's LSE,
    delta = rowsum(dO * O) of the merged output; dk and dv summed over the query-row slices."""
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out.to(dout.dtype)).sum(-1, keepdim=True)  # (B, H, Tq, 1)
    with torch.autocast(q.device.type, enabled=False):
        for rows in _row_slices(q, k.shape[-2]):
            probs = torch.exp(_scores(q, k, rows, causal, scale) - lse[..., rows].unsqueeze(-1).to(q.dtype))
            d_o = dout[..., rows, :]
            dscores = probs * (torch.matmul(d_o, v.transpose(-2, -1)) - delta[..., rows, :]) * scale
            dq[..., rows, :] = torch.matmul(dscores, k)
            dk += torch.matmul(dscores.transpose(-2, -1), q[..., rows, :])
            dv += torch.matmul(probs.transpose(-2, -1), d_o)
    return dq, dk, dv
