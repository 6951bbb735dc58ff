"""The MoE experts' grouped multiply under ``precision=fp8``. Pure torch, no Lightning.

Experts hold stacked weights (E, ., .), not Linear layers, so torchao's ``Float8Linear`` never takes them. Their
grouped multiply runs one of two ways, chosen once per run by :func:`experts_kernel` and said once in the log:

- ``float8``: torchao's rowwise float8 grouped GEMM (``torchao.prototype.moe_training``: triton casts, then
  ``torch._scaled_grouped_mm``), on a CUDA GPU of compute capability 9.0 or more (Hopper onwards: the scaled grouped
  GEMM's kernels) with triton, when emulation was not asked for. Rowwise whatever ``precision.recipe`` says (the
  only float8 grouped GEMM torchao 0.18 has for e4m3 with dynamic scales); each expert's group of rows is padded to a
  multiple of 16 (:func:`pad_groups`) as the kernel needs;
- ``bf16``: the same grouped multiply with its inputs and weights cast to the autocast dtype (bf16), everywhere else:
  on the CPU (torchao 0.18 has no emulated float8 grouped GEMM for tensorwise or rowwise scaling: its emulated paths
  are MXFP8's and 128-blockwise's, whose kernels still need triton), on Ada (8.9), ROCm, or with ``emulate=True``.

What each experts module becomes (:func:`convert_experts`, called by :func:`.float8.convert`):

- Hugging Face's experts (``@use_experts_implementation``: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), gated,
  no bias, not transposed: Mixtral, Qwen3-MoE, DeepSeek-V3) take a forward of their own (HF's grouped_mm
  experts forward with the multiply above). HF's own would run in the weights' dtype: ``grouped_mm`` has no autocast
  rule, so under ``bf16-mixed`` with fp32 master weights its experts multiply in fp32. Other layouts (biases,
  transposed weights: GPT-OSS) keep HF's forward, and the report says so;
- the recipe's :class:`~.expert.experts.GroupedExperts` multiply in the autocast dtype already: ``bf16`` leaves them
  as they are; ``float8`` gives them the float8 grouped GEMM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_parallel._compat as _compat
from lightning_parallel.parallel.dtensor import local

log = logging.getLogger(__name__)

FLOAT8, BF16 = "float8", "bf16"
GROUPED_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm: Hopper (sm90) onwards (not run on a GPU here)
ALIGN = 16  # the float8 grouped GEMM's rows per group, and both weight dimensions, in multiples of 16
_said: list[tuple[str, str]] = []


def experts_kernel(device: torch.device, emulate: bool) -> tuple[str, str]:
    """(``"float8"`` or ``"bf16"``, why) for the experts' grouped multiply on ``device`` (``emulate``: the float8
    linears run emulated)."""
    if device.type != "cuda":
        return (
            BF16,
            f"torchao's float8 grouped GEMM is CUDA-only (no emulated tensorwise/rowwise one), on {device.type}",
        )
    if emulate:
        return BF16, "float8 emulation was asked for, and torchao has no emulated float8 grouped GEMM"
    if torch.version.hip:
        return BF16, "torchao's float8 grouped GEMM is not checked on ROCm here"
    capability = torch.cuda.get_device_capability(device)
    if capability < GROUPED_CAPABILITY:
        return BF16, f"compute capability {capability[0]}.{capability[1]}: torch's scaled grouped GEMM needs 9.0"
    try:
        import triton  # noqa: F401  (torchao's casts for the grouped GEMM are triton kernels)
    except ImportError:
        return BF16, "torchao's float8 grouped GEMM needs triton, which is not installed"
    return FLOAT8, "torchao's rowwise float8 grouped GEMM"


def convert_experts(model: nn.Module, device: torch.device, emulate: bool) -> dict[str, str]:
    """Give ``model``'s experts modules the grouped multiply :func:`experts_kernel` picks (in place, before any
    parallelism splits the model); the choice is logged once per kind.

    Returns:
        path -> how that experts module multiplies (``"float8 grouped GEMM"``, ``"bf16 grouped GEMM (why)"``, or
        why it keeps HF's own forward).
    """
    kind, why = experts_kernel(device, emulate)
    report: dict[str, str] = {}
    for path, module in model.named_modules():
        if _is_recipe_experts(module) or _is_hf_experts(module):
            report[path] = _convert_one(module, kind, why)
    if report and (kind, why) not in _said:
        log.warning("precision=fp8: the MoE experts' grouped multiply runs in %s (%s)", kind, why)
        _said.append((kind, why))
    return report


def _is_recipe_experts(module: nn.Module) -> bool:
    """The recipe's ``parallel.expert.experts.GroupedExperts`` (by its attributes: ``parallel.expert`` imports
    ``parallel.tensor``, which imports this module's caller)."""
    w1 = getattr(module, "w1", None)
    return isinstance(w1, torch.Tensor) and w1.dim() == 3 and hasattr(module, "activation") and hasattr(module, "fused")


def _is_hf_experts(module: nn.Module) -> bool:
    weights = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    stacked = all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)
    return stacked and hasattr(module, "has_gate") and hasattr(module, "num_experts")


def _convert_one(module: nn.Module, kind: str, why: str) -> str:
    if kind == FLOAT8 and not _fits_float8(module):
        kind, why = BF16, "a weight dimension is no multiple of 16"
    if _is_recipe_experts(module):
        if kind == FLOAT8:
            module.__class__ = _subclass(type(module), _recipe_forward)
            module._float8_grouped = True
        return f"{kind} grouped GEMM" + ("" if kind == FLOAT8 else f" ({why})")
    odd = [f for f in ("has_bias", "is_transposed", "has_post_expert_norm") if getattr(module, f, False)]
    if odd or not module.has_gate:
        return f"HF's own forward ({', '.join(odd) or 'no gate'}): its grouped multiply in the weights' dtype"
    module.__class__ = _subclass(type(module), _hf_forward)
    module._float8_grouped = kind == FLOAT8
    return f"{kind} grouped GEMM" + ("" if kind == FLOAT8 else f" ({why})")


def _fits_float8(module: nn.Module) -> bool:
    return all(d % ALIGN == 0 for _, p in module.named_parameters(recurse=False) for d in p.shape[1:])


_SUBCLASSES: dict[type, type] = {}


def _subclass(cls: type, forward: Callable[..., Tensor]) -> type:
    """``cls`` with ``forward`` (one subclass per class: the state dict, ``isinstance`` and HF's hooks stay)."""
    if cls not in _SUBCLASSES:
        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__})
        sub.__qualname__ = f"Float8Experts[{cls.__qualname__}]"
        _SUBCLASSES[cls] = sub
    return _SUBCLASSES[cls]


def _hf_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """HF's grouped_mm experts forward (rows sorted by expert, one grouped multiply up, HF's gate, one down, the
    routing weights, each token's top-k rows summed in fp32) with :func:`grouped_linear`'s multiply."""
    tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
    ids, order = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[order // top_k]
    counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids)
    )
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # on the device: no host sync
    float8 = self._float8_grouped
    up = grouped_linear(rows, self.gate_up_proj, offsets, float8)
    down = grouped_linear(self._apply_gate(up), self.down_proj, offsets, float8)
    weighted = down * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return weighted[back].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _recipe_forward(self: nn.Module, rows: Tensor, counts: Tensor, max_count: int | None = None) -> Tensor:
    """The recipe's experts (``w1`` (E, d, f), ``w2`` (E, f, d), ``w3``) through the float8 grouped GEMM."""
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    w1, w2 = local(self.w1).transpose(-2, -1), local(self.w2).transpose(-2, -1)
    h = grouped_linear(rows, w1, offsets, True)
    if self.w3 is not None:
        h = F.silu(h) * grouped_linear(rows, local(self.w3).transpose(-2, -1), offsets, True)
    else:
        h = F.gelu(h)
    return grouped_linear(h, w2, offsets, True)


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor, float8: bool) -> Tensor:
    """``x`` (M, K), its rows grouped by expert (``offsets``: int32 group ends), times each group's expert weight
    ``weight`` (E, N, K) transposed, in the autocast dtype on ``x``'s device (the weights' dtype without autocast):
    torch's ``grouped_mm``, or with ``float8`` torchao's rowwise float8 grouped GEMM over groups padded to 16 rows."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    x, weight = x.to(dtype), weight.to(dtype).contiguous()  # (E, N, K): transposed, each expert column-major
    if not float8:
        return F.grouped_mm(_aligned(x), _aligned(weight).transpose(-2, -1), offs=offsets)
    kernel = _compat.float8_grouped_mm()

    def float8_kernel(rows: Tensor, weight_t: Tensor, ends: Tensor) -> Tensor:
        return kernel(rows, weight_t, ends, out_dtype=dtype, pad_token_groups_for_grouped_mm=False)

    return padded_grouped(x, weight, offsets, float8_kernel)


def padded_grouped(x: Tensor, weight: Tensor, offsets: Tensor, kernel: Callable[..., Tensor]) -> Tensor:
    """``kernel(rows, weight (E, K, N) column-major per expert, group ends)`` over ``x``'s groups each padded to a
    multiple of :data:`ALIGN` rows (zero rows: they add nothing to the weight gradient), its output unpadded."""
    padded, padded_offsets, index = pad_groups(x, offsets, ALIGN)
    return kernel(padded, weight.transpose(-2, -1), padded_offsets)[index]


def pad_groups(x: Tensor, offsets: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """``x``'s groups (int32 ``offsets``: their ends) each padded with zero rows to a multiple of ``align``, in a
    buffer of a size fixed by the shapes alone (no host sync; rows past the last group are ignored by the kernel).

    Returns:
        (padded rows, the padded groups' ends (int32), where each row of ``x`` went)
    """
    groups, rows = offsets.numel(), x.shape[0]
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_counts = (counts + align - 1) // align * align
    padded_ends = torch.cumsum(padded_counts, 0)
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts, output_size=rows)
    index = torch.arange(rows, device=x.device) + (padded_ends - padded_counts - (ends - counts))[group]
    size = (rows + groups * (align - 1) + align - 1) // align * align
    padded = x.new_zeros(size, x.shape[1]).index_copy(0, index, x)
    return padded, padded_ends.to(torch.int32), index


def _aligned(t: Tensor) -> Tensor:
    """``t`` contiguous at a 16-byte address (grouped_mm's requirement), as ``parallel.expert.experts`` does; traced
    or fake (the simulator), there is no address to read."""
    t = t.contiguous()
    if torch.compiler.is_compiling() or _compat.is_fake_tensor(t):
        return t
    return t if t.data_ptr() % 16 == 0 else t.clone()
