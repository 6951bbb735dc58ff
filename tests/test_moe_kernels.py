"""The experts' two kernels, no process group: the grouped GEMM (CUDA's) and the padded batched matmul (its twin)
give the outputs and gradients of a loop over the experts, the MoE layer on the grouped path makes no host sync,
and the experts' initial values are drawn expert by expert exactly as one whole draw."""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel.parallel.expert import MoE
from lightning_parallel.parallel.expert import experts as kernels
from lightning_parallel.parallel.expert.dispatch import count_per_expert
from lightning_parallel.parallel.expert.experts import (
    draw_experts,
    expert_forward,
    grouped_by_default,
    grouped_mm_fits,
)

# ops that wait for the device on CUDA: a value read on the host, or an output whose size depends on the data
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.bincount", "aten.masked_select", "aten.unique_dim"}


class _SyncOps(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if name in SYNC_OPS or (name == "aten.repeat_interleave" and kwargs.get("output_size") is None):
            self.found.append(f"{name}.{func._overloadname}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_syncs() -> Iterator[list[str]]:
    """The host syncs made inside, as CUDA would make them, also on CPU: the ops above, and every ``item``,
    ``tolist``, ``cpu`` and ``numpy`` call (named ``Tensor.<method>``)."""
    found: list[str] = []
    patches = contextlib.ExitStack()
    for method in ("item", "tolist", "cpu", "numpy"):
        real = getattr(torch.Tensor, method)

        def counted(self, *args, _real=real, _name=method, **kwargs):
            found.append(f"Tensor.{_name}")
            return _real(self, *args, **kwargs)

        patches.enter_context(unittest.mock.patch.object(torch.Tensor, method, counted))
    with patches, _SyncOps(found):
        yield found


COUNTS = [5, 0, 9, 2]  # an expert with no rows, uneven loads


def _weights(activation: str, dtype=torch.float32, d=16, f=32):
    g = torch.Generator().manual_seed(3)
    e = len(COUNTS)
    w1 = torch.randn(e, d, f, generator=g).to(dtype).requires_grad_()
    w2 = torch.randn(e, f, d, generator=g).to(dtype).requires_grad_()
    w3 = torch.randn(e, d, f, generator=g).to(dtype).requires_grad_() if activation == "swiglu" else None
    x = torch.randn(sum(COUNTS), d, generator=g).to(dtype).requires_grad_()
    return x, w1, w2, w3


def _loop(x, w1, w2, w3):
    """Each expert's rows through its FFN, one expert at a time (fp32)."""
    outs, start = [], 0
    for e, n in enumerate(COUNTS):
        rows = x[start : start + n].float()
        h = rows @ w1[e].float()
        h = F.silu(h) * (rows @ w3[e].float()) if w3 is not None else F.gelu(h)
        outs.append(h @ w2[e].float())
        start += n
    return torch.cat(outs)


def _run(fused, activation, dtype=torch.float32):
    x, w1, w2, w3 = _weights(activation, dtype)
    out = expert_forward(x, torch.tensor(COUNTS), w1, w2, w3, activation, fused=fused)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    tensors = [x, w1, w2] + ([w3] if w3 is not None else [])
    return out, [t.grad for t in tensors], tensors


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_and_padded_kernels_agree_with_a_loop_outputs_and_gradients(activation):
    grouped, grouped_grads, _ = _run(True, activation)
    padded, padded_grads, _ = _run(False, activation)
    x, w1, w2, w3 = _weights(activation)
    loop = _loop(x, w1, w2, w3)
    loop.backward(torch.linspace(-1, 1, loop.numel()).view_as(loop))
    loop_grads = [t.grad for t in (x, w1, w2, w3) if t is not None]
    for name, got in (("grouped", grouped), ("padded", padded)):
        torch.testing.assert_close(got, loop, rtol=1e-5, atol=1e-5, msg=f"{name} output")
    for i, (g, p, ref) in enumerate(zip(grouped_grads, padded_grads, loop_grads)):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5, msg=f"grouped grad {i}")
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-5, msg=f"padded grad {i}")
    assert grouped_grads[1][1].abs().sum() == 0 and padded_grads[1][1].abs().sum() == 0  # expert 1: no rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_kernel_in_half_precision_matches_the_padded_twin(dtype):
    grouped, grouped_grads, _ = _run(True, "swiglu", dtype)
    padded, padded_grads, _ = _run(False, "swiglu", dtype)
    assert grouped.dtype == padded.dtype == dtype
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(grouped.float(), padded.float(), **tol)
    for g, p in zip(grouped_grads, padded_grads):
        torch.testing.assert_close(g.float(), p.float(), **tol)


def test_grouped_kernel_under_autocast_computes_in_the_autocast_dtype():
    x, w1, w2, _ = _weights("gelu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped = expert_forward(x, torch.tensor(COUNTS), w1, w2, fused=True)
        padded = expert_forward(x, torch.tensor(COUNTS), w1, w2, fused=False)
    assert grouped.dtype == padded.dtype == torch.bfloat16
    torch.testing.assert_close(grouped.float(), padded.float(), rtol=2e-2, atol=2e-2)


def test_kernel_choice_by_device_and_fit(monkeypatch):
    calls = []
    real = kernels.F.grouped_mm
    monkeypatch.setattr(kernels.F, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w1, w2, _ = _weights("gelu")
    expert_forward(x, torch.tensor(COUNTS), w1, w2)  # CPU, fused=None: the padded twin
    assert not calls
    expert_forward(x, torch.tensor(COUNTS), w1, w2, fused=True)
    assert len(calls) == 2
    assert grouped_mm_fits(torch.bfloat16, w1) and grouped_mm_fits(torch.float32, torch.empty(2, 4, 12))
    assert not grouped_mm_fits(torch.bfloat16, torch.empty(2, 4, 12))  # 8 bytes a row: not a multiple of 16
    assert not grouped_mm_fits(torch.float64, w1)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert grouped_by_default(cuda, torch.bfloat16, w1)
    assert not grouped_by_default(cuda, torch.float32, w1)  # torch's fallback (host offsets); compile refuses it
    assert not grouped_by_default(cuda, torch.bfloat16, torch.empty(2, 4, 12))
    assert not grouped_by_default(cpu, torch.bfloat16, w1)
    with pytest.raises(ValueError, match="activation='swiglu' with w3 missing"):
        expert_forward(x, torch.tensor(COUNTS), w1, w2, None, "swiglu")
    with pytest.raises(ValueError, match="activation='relu'"):
        expert_forward(x, torch.tensor(COUNTS), w1, w2, None, "relu")


def test_counts_per_expert_from_sorted_ids():
    ids = torch.tensor([0, 0, 2, 2, 2, 3])
    assert count_per_expert(ids, 5).tolist() == [2, 0, 3, 1, 0]
    assert count_per_expert(ids[:0], 3).tolist() == [0, 0, 0]


def _moe(fused, **kwargs):
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, 2, z_loss_coeff=0.01, **kwargs)
    moe.experts.fused = fused
    return moe, torch.randn(2, 6, 16)


def test_moe_layer_without_expert_parallelism_makes_no_host_sync_on_the_grouped_path():
    """What CUDA runs (fused, dropless), forward and backward, statistics recorded; the detector finds the padded
    kernel's one read of the largest count and a capacity mask's kept count, so it is not blind."""
    moe, x = _moe(True)
    with host_syncs() as syncs:
        moe(x).square().mean().backward()
    assert syncs == [], syncs
    assert sum(moe.stats()["tokens_per_expert"]) == 2 * 6 * 2  # recorded all the same

    moe, x = _moe(False)
    with host_syncs() as syncs:
        moe(x).sum().backward()
    assert syncs == ["aten._local_scalar_dense.default"], syncs

    moe, x = _moe(True, capacity_factor=0.5)
    with host_syncs() as syncs:
        moe(x).sum().backward()
    assert syncs == ["aten.nonzero.default"], syncs


def test_moe_layer_outputs_and_gradients_equal_on_both_kernels():
    results = []
    for fused in (True, False):
        moe, x = _moe(fused, activation="swiglu", shared_hidden=8)
        moe(x).square().mean().backward()
        results.append((moe(x).detach(), {n: p.grad for n, p in moe.named_parameters()}))
    (out_g, grads_g), (out_p, grads_p) = results
    torch.testing.assert_close(out_g, out_p, rtol=1e-5, atol=1e-6)
    for name in grads_g:
        torch.testing.assert_close(grads_g[name], grads_p[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("shape", [(8, 32, 128), (4, 16, 24), (3, 5, 7)])  # the last: 35 values an expert
def test_expert_by_expert_draws_equal_one_whole_draw_on_every_ep_rank(shape):
    def generator():
        return torch.Generator().manual_seed(11)

    whole_gen = generator()
    whole = torch.randn(shape, generator=whole_gen) * 0.02  # what one process always drew
    after = torch.randn(4, generator=whole_gen)  # what the layer's next weights draw
    for ep in (1, 2, 4) if shape[0] % 4 == 0 else (1, 3):
        rows = shape[0] // ep
        for rank in range(ep):
            gen = generator()
            part = draw_experts(torch.Size(shape), rank * rows, (rank + 1) * rows, 0.02, gen)
            assert torch.equal(part, whole[rank * rows : (rank + 1) * rows]), f"ep={ep} rank {rank}"
            assert torch.equal(torch.randn(4, generator=gen), after), f"ep={ep} rank {rank}: generator state"


def test_layer_init_is_unchanged_by_drawing_expert_by_expert():
    gen = torch.Generator().manual_seed(5)
    moe = MoE(32, 128, 8, 2, activation="swiglu")
    moe.experts.reset_parameters(gen, std=0.02, out_std=0.01)
    gen = torch.Generator().manual_seed(5)
    for name, sigma in (("w1", 0.02), ("w3", 0.02), ("w2", 0.01)):  # the order and scales of the whole draws
        want = torch.randn(getattr(moe.experts, name).shape, generator=gen) * sigma
        assert torch.equal(getattr(moe.experts, name).detach(), want), name
