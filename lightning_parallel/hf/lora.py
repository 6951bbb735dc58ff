"""LoRA adapters (the ``peft`` library's own) on a Hugging Face causal LM: the checks before any process starts, the
wrapping, and the tensor-parallel plan of the wrapped model.

The model is wrapped by peft's ``get_peft_model``, so modules, parameter names and ``save_pretrained`` are peft's;
the base is frozen (``requires_grad=False``) and only the adapters train. Under tp each LoRA layer follows its base
layer's style (:class:`~lightning_parallel.parallel.tensor.styles.LoraParallel`): the plan HF describes for the
base model is translated as usual, and every entry that names a LoRA layer gets the style derived from it. Needs the
``peft`` extra (``pip install lightning-parallel[peft]``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.tensor.plan import path_matches
from lightning_parallel.parallel.tensor.styles import LoraParallel

SUPPORTED = "LoraConfig (LoRA)"
# HFCausalLM(base_dtype=...): the dtypes a frozen base may be kept in, by the names a config gives them
BASE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
EXPERTS = (
    "LoRA on MoE routers or experts ({where}) is not supported yet: adapt the attention projections and dense or "
    "shared MLPs by name (e.g. target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']; peft's 'all-linear' reaches "
    "the experts)."
)


def check_peft_config(model: nn.Module, config: Any) -> None:
    """Refuse a peft method other than LoRA, LoRA variants this package does not split, and target modules that
    match no module of ``model`` (listing the names it has).

    Raises:
        TypeError: not a ``LoraConfig``.
        ValueError: naming the setting and the fix.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"HFCausalLM(peft_config=...) supports {SUPPORTED}, not {type(config).__name__}: pass a "
            "peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...])."
        )
    _refuse_expert_adapters(model, config)
    targets = config.target_modules
    if targets is None or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return  # peft picks the model type's defaults (or every linear layer) and says so if it has none
    names = [name for name, _ in model.named_modules() if name]
    if not any(check_target_module_exists(config, name) for name in names):
        leaves = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if _adaptable(m)})
        raise ValueError(
            f"LoraConfig(target_modules={targets!r}) matches no module of {type(model).__name__} (with its "
            f"layers_to_transform / exclude_modules): its adaptable modules are {leaves}. Name some of those."
        )


def _refuse_expert_adapters(model: nn.Module, config: Any) -> None:
    """Adapters on MoE experts (transformers 5 keeps each layer's experts as 3-D parameters: Mixtral, Qwen-MoE,
    DeepSeek), named by module or by peft's ``target_parameters``, are refused by name."""
    from peft.tuners.tuners_utils import check_target_module_exists

    experts = [
        name for name, m in model.named_modules()
        if name and any(p.dim() == 3 for p in m.parameters(recurse=False))
    ]  # fmt: skip
    named = [name for name in experts if config.target_modules and check_target_module_exists(config, name)]
    if named or getattr(config, "target_parameters", None):
        where = named[0] if named else f"target_parameters={config.target_parameters!r}"
        raise ValueError(EXPERTS.format(where=where))


def _adaptable(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, nn.Embedding, Conv1D))


def apply_peft(model: nn.Module, config: Any, seed: int = 0) -> nn.Module:
    """``get_peft_model(model, config)`` with the adapters drawn from ``seed`` (the global generator is left as it
    was): every process that builds the model gets the same adapters, so replicated factors agree on every rank
    whatever the caller seeded, and a single-process reference with the same seed starts from the same values."""
    from peft import get_peft_model
    from peft.tuners.lora import ParamWrapper

    check_peft_config(model, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapted = get_peft_model(model, config)
    on_experts = [name for name, m in adapted.named_modules() if isinstance(m, ParamWrapper)]
    if on_experts:  # "all-linear" reaches a MoE model's experts through peft's target_parameters
        raise ValueError(EXPERTS.format(where=on_experts[0]))
    return adapted


def resolve_base_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype ``HFCausalLM(base_dtype=...)`` names: ``torch.bfloat16`` / ``torch.float32`` or one of the strings
    of :data:`BASE_DTYPES`; None keeps the base as loaded.

    Raises:
        ValueError: another dtype or string (fp16 would need a loss scale for the activations' gradients).
        TypeError: neither a dtype nor a string.
    """
    if value is None or value in BASE_DTYPES.values():
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value.lower() in BASE_DTYPES:
        return BASE_DTYPES[value.lower()]
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(f"HFCausalLM(base_dtype=...) takes a torch.dtype or a string, not {type(value).__name__}.")
    raise ValueError(
        f"HFCausalLM(base_dtype={value!r}) is not supported: use one of {sorted(BASE_DTYPES)} (or torch.bfloat16 / "
        "torch.float32), or None to keep the base as loaded."
    )


def cast_frozen_base(model: nn.Module, dtype: torch.dtype) -> int:
    """Every frozen floating-point parameter of ``model`` converted to ``dtype`` in place; the trainable ones (the
    adapters, and so their gradients and optimizer states) and the buffers stay as they are. peft's LoRA layers
    cast their input to the adapter's dtype (``Linear.forward``: ``_cast_input_dtype(x, lora_A.weight.dtype)``) and
    their sum back to the base output's, so a bf16 base with fp32 adapters computes each adapter in fp32 and
    keeps the residual stream in bf16. Returns the number of parameters converted."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point() and p.dtype != dtype]
    for p in frozen:  # tied weights are one Parameter: converted once, still tied
        p.data = p.data.to(dtype)
    return len(frozen)


def is_peft_model(model: nn.Module) -> bool:
    if "peft" not in sys.modules:  # never imported: no model of its kind either
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def has_lora_layers(model: nn.Module) -> bool:
    """Whether peft injected LoRA layers into ``model`` (no need to import peft to know it has not)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def base_of(model: nn.Module) -> tuple[nn.Module, str]:
    """The Hugging Face model inside ``model`` and its path there (``model`` itself and "" unless peft wrapped
    it; then the model with the LoRA layers in place, at ``base_model.model``)."""
    if is_peft_model(model):
        return model.get_base_model(), "base_model.model."
    return model, ""


def check_peft_degrees(config: Any, dims: ParallelDims) -> None:
    """Refuse, under tp, the LoRA variants whose extra parameters or random masks the split does not follow, before
    any process group exists (LoRA runs under ZeRO 0-3, HSDP, tp, pp, cp and ep).

    Raises:
        ValueError: naming the setting and what works.
    """
    if dims.tp > 1:
        for setting, neutral in (("use_dora", False), ("lora_dropout", 0.0)):
            value = getattr(config, setting, neutral)
            if value and value != neutral:
                raise ValueError(
                    f"LoraConfig({setting}={value!r}) with tp={dims.tp} is not supported yet: set "
                    f"{setting}={neutral!r}, or tp=1 (ZeRO 0-3 take it)."
                )


def lora_tensor_parallel_plan(root: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` (paths relative to ``root``) with every entry that names peft LoRA layers given the style derived
    from it (:class:`LoraParallel`). A pattern that names LoRA layers and plain ones alike (``layers_to_transform``)
    is written out path by path.

    Raises:
        ValueError: a LoRA layer of a kind the split does not follow (an adapted embedding).
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    modules = dict(root.named_modules())
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        paths = [path for path in modules if path_matches(path, pattern)]
        adapted = [path for path in paths if isinstance(modules[path], LoraLayer)]
        if not adapted:
            out[pattern] = style
            continue
        for path in adapted:
            if not isinstance(modules[path], LoraLinear):
                raise ValueError(
                    f"LoRA on {path} ({type(modules[path]).__name__}) with tp > 1 is not supported yet: only linear "
                    "(and GPT-2 Conv1D) layers follow their base layer's split; drop it from target_modules or use "
                    "tp=1."
                )
        if len(adapted) == len(paths):
            out[pattern] = LoraParallel(style)
            continue
        out.update({path: LoraParallel(style) if path in adapted else style for path in paths})
    return out
