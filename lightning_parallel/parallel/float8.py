"""FP8 training through torchao's float8 (``torchao.float8``, the optional extra ``fp8``). Pure torch, no Lightning.

The Linear layers of a model become torchao ``Float8Linear``s (their matrix multiplies in float8 with dynamic
scales, tensorwise or rowwise; their weights stay high precision: fp32 master weights, checkpoints, exports), every
other operation runs under the ``bf16-mixed`` autocast the precision plugin keeps. Left in high precision by name
(:data:`KEEP_HIGH_PRECISION`, the last part of a module's path): the output head, routers and MoE gates, plus any
Linear whose dimensions are not both multiples of 16 (float8 GEMMs need them); embeddings and norms are not Linear
layers and are never converted. Where things meet:

- tensor parallelism (``parallel/tensor/plan.py: apply_tp``): a ``ColwiseParallel`` / ``RowwiseParallel`` entry on
  a converted layer becomes torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` (:func:`float8_tp_plan`),
  tensorwise only (torchao's float8 tp styles assume one scale per tensor);
- ZeRO-3 (FSDP2): with ``fsdp_float8_all_gather`` each converted weight is all-gathered in float8 (1 byte an element
  instead of bf16's 2), tensorwise only; without it the weights are gathered as the run's ``param_dtype`` (bf16);
- on the CPU the float8 GEMMs are emulated (``emulate=True``, the same numerics); on a GPU below compute capability
  8.9 (before Ada / Hopper) fp8 is refused unless emulation is asked for.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import lightning_parallel._compat as _compat

log = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
# the last part of a Linear's path (or the whole path) that keeps it in high precision: output heads (their logits
# feed the loss, and vocabularies are rarely multiples of 16), routers and MoE gates (fp32 routing decisions),
# classifiers, LoRA's adapters (peft's lora_A / lora_B: small, trained; the frozen base layer beside them converts)
KEEP_HIGH_PRECISION = (
    "lm_head", "head", "output", "score", "classifier", "router", "gate", "*.router", "*_router", "*.lora_A.*",
    "*.lora_B.*",
)  # fmt: skip
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
_said_emulated = False


def _need_torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as err:  # pragma: no cover - the extra is installed in the test environment
        raise ImportError(
            "precision=fp8 needs torchao: pip install 'lightning-parallel[fp8]' (torchao==0.18.0, --no-deps keeps "
            "your torch)."
        ) from err
    return float8


@dataclass(frozen=True)
class Float8Settings:
    """How a model trains in FP8.

    Attributes:
        recipe: ``"tensorwise"`` (one scale per tensor: the fastest, and the only one torchao's float8 all-gather and
            tensor-parallel styles support) or ``"rowwise"`` (a scale per row: more accurate, CUTLASS kernels).
        fsdp_float8_all_gather: under ZeRO-3, all-gather the converted weights in float8 (tensorwise only).
        keep: module names (the last part of the path; fnmatch patterns) left in high precision.
        emulate: run the float8 GEMMs in emulation. None: on the CPU yes (said once in the log), on a GPU no.
    """

    recipe: str = "tensorwise"
    fsdp_float8_all_gather: bool = False
    keep: tuple[str, ...] = KEEP_HIGH_PRECISION
    emulate: bool | None = None

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"precision.recipe={self.recipe!r} is unknown: use one of {', '.join(RECIPES)}.")
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"precision.fsdp_float8_all_gather=True with precision.recipe={self.recipe!r}: torchao's float8 "
                "all-gather supports tensorwise scaling only: set precision.recipe=tensorwise or "
                "precision.fsdp_float8_all_gather=false."
            )
        object.__setattr__(self, "keep", tuple(self.keep))

    def check_layout(self, tp: int = 1, zero_stage: int = 0, ep: int = 1) -> None:
        """Refuse what this setting cannot do under a layout, before any process group exists."""
        if tp > 1 and self.recipe != "tensorwise":
            raise ValueError(
                f"precision.recipe={self.recipe!r} with tp={tp}: torchao's float8 tensor-parallel styles support "
                "tensorwise scaling only: set precision.recipe=tensorwise, or tp=1."
            )
        if self.fsdp_float8_all_gather and zero_stage != 3:
            raise ValueError(
                f"precision.fsdp_float8_all_gather=True with zero_stage={zero_stage}: only ZeRO-3 all-gathers weights: "
                "set precision.fsdp_float8_all_gather=false, or use ZeRO-3 (strategy=zero3)."
            )

    def torchao_config(self, emulate: bool) -> Any:
        """torchao's ``Float8LinearConfig`` for this setting."""
        float8 = _need_torchao()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        fields = {"emulate": emulate, "enable_fsdp_float8_all_gather": self.fsdp_float8_all_gather}
        return _replace(config, **fields)

    def keeps(self, path: str, module: nn.Module) -> str | None:
        """Why ``module`` at ``path`` stays in high precision (None: it is converted)."""
        name = path.rsplit(".", 1)[-1]
        if any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(path, p) for p in self.keep):
            return "kept by name"
        if isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16):
            return f"{module.in_features} x {module.out_features} is not a multiple of 16"
        return None


def _replace(config: Any, **fields: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **fields)


def resolve_emulate(settings: Float8Settings, device: torch.device) -> bool:
    """Whether the float8 GEMMs run emulated on ``device``; a GPU below compute capability 8.9 is refused by name
    unless ``settings.emulate`` asks for emulation."""
    global _said_emulated
    if device.type != "cuda":
        if settings.emulate is False:
            raise ValueError(
                f"precision=fp8 with emulate=False on {device.type}: float8 GEMMs need a CUDA GPU of compute "
                "capability 8.9 or more: leave emulate unset (emulated on the CPU) or run on such a GPU."
            )
        if not _said_emulated:
            log.warning("precision=fp8 on %s: float8 matmuls emulated (same numerics, no speed-up)", device.type)
            _said_emulated = True
        return True
    if settings.emulate:
        return True
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"precision=fp8 on {name} (compute capability {capability[0]}.{capability[1]}): float8 tensor cores need "
            "8.9 or more (L4, L40, RTX 4090, H100, H200, B200): use precision=bf16-mixed, or ask for emulation "
            "(Float8Precision(emulate=True)), which is slower than bf16."
        )
    return False


def convert(model: nn.Module, settings: Float8Settings, device: torch.device) -> dict[str, str]:
    """Swap ``model``'s Linear layers for torchao's ``Float8Linear`` in place (before any parallelism splits it).

    Returns:
        path -> ``"float8"`` or the reason it stayed in high precision, for every Linear layer; and for every MoE
        experts module how its grouped multiply runs (:mod:`.float8_experts`).
    """
    float8 = _need_torchao()
    emulate = resolve_emulate(settings, device)
    config = settings.torchao_config(emulate)
    _host_gathers_as_bytes()
    report: dict[str, str] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, float8.float8_linear.Float8Linear):
            report[path] = settings.keeps(path, module) or "float8"

    def keep_out(module: nn.Module, path: str) -> bool:
        return report.get(path) == "float8"

    float8.convert_to_float8_training(model, module_filter_fn=keep_out, config=config)
    for module in model.modules():
        if type(module) is float8.float8_linear.Float8Linear:
            module.__class__ = _mixed_class()
            module.register_state_dict_post_hook(_plain_weights)
    from lightning_parallel.parallel.float8_experts import convert_experts  # experts: stacked weights, no Linear

    return {**report, **convert_experts(model, device, emulate)}


_PATCHED: list[bool] = []


def _host_gathers_as_bytes() -> None:
    """gloo refuses float8 collectives ("Invalid scalar type"): torchao's all-gather of a float8 tensor (tp's
    float8 styles gather fp8 activations and gradients) goes as a uint8 view of the same bytes for tensors on the host,
    finished at once; device tensors keep torchao's own path (NCCL takes float8). torchao's op table is its own
    extension point (``float8_ops.FLOAT8_OPS_TABLE``); FSDP2's float8 all-gather packs its inputs into one uint8 buffer
    already where a unit's dtypes are mixed."""
    if _PATCHED:
        return
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    table, ops = _compat.float8_gather_ops()
    torchao_gather = table[ops[0]]

    def gather(aten_op: Any, args: Any, kwargs: Any = None) -> Any:
        fp8 = args[0]
        if fp8._data.device.type != "cpu":
            return torchao_gather(aten_op, args, kwargs)
        data = fp8._data.contiguous()
        out = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {}))
        out = torch.ops._c10d_functional.wait_tensor(out).view(data.dtype)
        return Float8TrainingTensor(out, fp8._scale, fp8._orig_dtype, fp8._linear_mm_config, fp8._gemm_input_role)

    for op in ops:
        table[op] = gather
    _PATCHED.append(True)


def plain_tensor(t: Any) -> Any:
    """``t`` without torchao's float8 all-gather wrapper (also inside a DTensor): checkpoints, exports and gathered
    state dicts hold ordinary high-precision tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t.to_local()
        inner = plain_tensor(local)
        if inner is local:
            return t
        return DTensor.from_local(inner, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)
    inner = getattr(t, "_tensor", None)
    wrapped = type(t).__name__ == "WeightWithDynamicFloat8CastTensor" and inner is not None
    return inner.detach() if wrapped else t


def _plain_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = plain_tensor(state_dict[key])


_MIXED: list[type] = []


def _mixed_class() -> type:
    """torchao's ``Float8Linear`` that reads the autocast of its input's device (torchao's reads CUDA's only: on the
    CPU its input and weight stayed fp32) and casts its weight to the autocast dtype before the float8 cast, as
    ZeRO-3's bf16 gather does: one process and every layout quantize the same bf16 values (with float8 all-gather
    the fp32 shards are quantized instead, with the whole weight's amax)."""
    if _MIXED:
        return _MIXED[0]
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class MixedFloat8Linear(Float8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            weight = self.weight
            device = input.device.type
            if torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
                input = input.to(dtype)
                if not tensor_already_casted_to_fp8(weight):
                    weight = weight.to(dtype)
            output = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config, self.config)
            return output + self.bias.to(output.dtype) if self.bias is not None else output

    MixedFloat8Linear.__module__ = __name__
    _MIXED.append(MixedFloat8Linear)
    return MixedFloat8Linear


def is_float8_linear(module: nn.Module) -> bool:
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return False
    return isinstance(module, Float8Linear)


def float8_tp_plan(root: nn.Module, plan: Mapping[str, Any], matches: Callable[[str, str], bool]) -> dict[str, Any]:
    """``plan`` with torchao's float8 tp styles on the converted layers: an entry whose style is exactly
    ``ColwiseParallel`` / ``RowwiseParallel`` and that names converted layers is written out per layer, the
    converted ones with ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` (same layouts), the others as they
    were. A plan on a model without Float8Linear layers comes back unchanged."""
    converted = [path for path, m in root.named_modules() if is_float8_linear(m)]
    if not converted:
        return dict(plan)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    swaps = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        float8_style = swaps.get(type(style))
        hits = [p for p in converted if matches(p, pattern)]
        if float8_style is None or not hits:
            out[pattern] = style
            continue
        for path, _ in root.named_modules():
            if matches(path, pattern):
                out[path] = _same_layouts(float8_style, style) if path in hits else style
    return out


def _same_layouts(cls: type, style: Any) -> Any:
    return cls(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )


def converted_weights(model: nn.Module) -> list[str]:
    """The parameter names of the converted layers' weights (what float8 all-gather moves in float8)."""
    return [f"{path}.weight" if path else "weight" for path, m in model.named_modules() if is_float8_linear(m)]
