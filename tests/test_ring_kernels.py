"""Ring attention's block kernels (lightning_parallel/parallel/context/kernels.py), without any process group.

The kernel is picked by device (a pure function); the unfused math twin and torch's fused CPU flash kernel give the
same outputs, log-sum-exps and gradients, on the block shapes the ring uses (its own causal block, all rows against
half the keys, half the rows against all keys) and with the math cut into row slices; the CUDA kernels' calls are
checked on meta tensors (argument order, shapes and dtypes of out, lse and the gradients: no GPU needed); the
in-place merge of two blocks equals one block over all their keys.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.parallel.context import kernels, ring
from lightning_parallel.parallel.context.kernels import (
    block_attention,
    block_attention_backward,
    compute_dtype,
    kernel_for,
    pick_kernel,
)

SCALE = 0.3
# (rows of q, keys of k and v, causal): the ring's own block, a block seen by every row, half the rows' block
BLOCKS = [(8, 8, True), (8, 4, False), (4, 8, False)]


def _tensors(tq: int, tk: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, 3, tq, 16, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 3, tk, 16, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dout


@pytest.mark.parametrize(
    ("device", "flash", "efficient", "want"),
    [
        ("cpu", False, False, "cpu_flash"),
        ("cpu", True, True, "cpu_flash"),
        ("cuda", True, True, "cuda_flash"),
        ("cuda", True, False, "cuda_flash"),
        ("cuda", False, True, "cuda_efficient"),  # fp32, or flash ruled out by sdpa_kernel / the GPU
        ("cuda", False, False, "math"),  # fp64, a head size neither kernel takes
        ("mps", True, True, "math"),
        ("xpu", False, False, "math"),
    ],
)
def test_kernel_is_picked_by_device_and_what_the_cuda_kernels_accept(device, flash, efficient, want):
    assert pick_kernel(device, flash, efficient) == want


def test_kernel_for_tensors_off_cuda():
    assert kernel_for(torch.zeros(1, 1, 4, 8)) == "cpu_flash"
    assert kernel_for(torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)) == "cpu_flash"
    assert kernel_for(torch.zeros(1, 1, 4, 8, device="meta")) == "math"
    with pytest.raises(ValueError, match="kernel='flash'.*one of"):
        block_attention(*_tensors(4, 4)[:3], True, SCALE, kernel="flash")


def test_compute_dtypes():
    assert compute_dtype("cuda_flash", torch.bfloat16) == torch.bfloat16
    assert compute_dtype("cuda_efficient", torch.float32) == torch.float32
    assert compute_dtype("cpu_flash", torch.bfloat16) == torch.float32
    assert compute_dtype("math", torch.float16) == torch.float32
    assert compute_dtype("math", torch.float64) == torch.float64


@pytest.mark.parametrize(("tq", "tk", "causal"), BLOCKS)
@pytest.mark.parametrize("slices", [False, True], ids=["whole", "row-slices"])
def test_math_twin_equals_the_cpu_flash_kernel_at_fp32(tq, tk, causal, slices, monkeypatch):
    """Outputs, log-sum-exps and gradients (given the merged row's out and lse, here the block's own) agree to fp32
    rounding; with ``slices`` the math runs 3 query rows at a time."""
    q, k, v, dout = _tensors(tq, tk)
    flash_out, flash_lse = block_attention(q, k, v, causal, SCALE, kernel="cpu_flash")
    flash_grads = block_attention_backward(dout, q, k, v, flash_out, flash_lse, causal, SCALE, kernel="cpu_flash")
    if slices:
        monkeypatch.setattr(kernels, "MATH_SCORES", 2 * 3 * tk * 3)
    math_out, math_lse = block_attention(q, k, v, causal, SCALE, kernel="math")
    math_grads = block_attention_backward(dout, q, k, v, flash_out, flash_lse, causal, SCALE, kernel="math")
    assert math_out.shape == flash_out.shape and math_lse.shape == flash_lse.shape == (2, 3, tq)
    assert math_out.dtype == flash_out.dtype == math_lse.dtype == flash_lse.dtype == torch.float32
    torch.testing.assert_close(math_out, flash_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(math_lse, flash_lse, rtol=1e-5, atol=1e-6)
    for name, got, want in zip(("dq", "dk", "dv"), math_grads, flash_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernels_equal_autograd_through_sdpa_at_fp64(kernel, causal):
    q, k, v, dout = _tensors(8, 8, torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=SCALE)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    out, lse = block_attention(q, k, v, causal, SCALE, kernel=kernel)
    grads = block_attention_backward(dout, q, k, v, out, lse, causal, SCALE, kernel=kernel)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_calls_on_meta_tensors(kernel, dtype):
    """The aten calls as the ring makes them (meta kernels check the arguments): out in the input dtype, lse
    (B, H, Tq) fp32 (the efficient kernel's padding to 32 rows cut off), gradients in the input dtype."""
    q, k, v, dout = (torch.empty(2, 3, 40, 64, device="meta", dtype=dtype) for _ in range(4))
    for tk, causal in ((40, True), (20, False)):
        out, lse = block_attention(q, k[..., :tk, :], v[..., :tk, :], causal, SCALE, kernel=kernel)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (2, 3, 40), torch.float32)
        grads = block_attention_backward(dout, q, k[..., :tk, :], v[..., :tk, :], out, lse, causal, SCALE, kernel)
        assert [(g.shape[-2], g.dtype) for g in grads] == [(40, dtype), (tk, dtype), (tk, dtype)]


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_in_place_merge_of_two_blocks_equals_one_block(kernel):
    """The ring's merge: attention over keys [0, 8) merged with attention over keys [8, 16) (all rows, in place on
    the running output and lse) equals attention over all 16 keys; then half the rows against a third block."""
    q, k, v, _ = _tensors(8, 24)
    out, lse = block_attention(q, k[..., :8, :], v[..., :8, :], False, SCALE, kernel)
    out, lse = out.clone(), lse.contiguous()
    ring._merge(out, lse, slice(None), *block_attention(q, k[..., 8:16, :], v[..., 8:16, :], False, SCALE, kernel))
    want_out, want_lse = block_attention(q, k[..., :16, :], v[..., :16, :], False, SCALE, kernel)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    rows = slice(4, None)
    ring._merge(out, lse, rows, *block_attention(q[..., rows, :], k[..., 16:, :], v[..., 16:, :], False, SCALE, kernel))
    all_keys = block_attention(q[..., rows, :], k, v, False, SCALE, kernel)
    torch.testing.assert_close(out[..., rows, :], all_keys[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[..., rows], all_keys[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[..., :4, :], want_out[..., :4, :])  # the other rows untouched


@pytest.mark.parametrize("causal", [True, False])
def test_autograd_through_the_math_twin_and_the_cpu_kernel_agrees(causal):
    """Used as plain differentiable functions (the GPU check does): the output's gradients agree, and neither
    log-sum-exp is differentiable (torch declares the fused kernels' so)."""
    q, k, v, dout = _tensors(8, 8)
    grads = {}
    for kernel in ("cpu_flash", "math"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = block_attention(*leaves, causal, SCALE, kernel=kernel)
        assert out.requires_grad and not lse.requires_grad, kernel
        grads[kernel] = torch.autograd.grad(out, leaves, dout)
    for got, want in zip(grads["math"], grads["cpu_flash"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
