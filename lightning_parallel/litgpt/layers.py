"""Pipeline layers of LitGPT's ``GPT``: its own modules in forward order, each able to run on the previous one's
output alone.

``GPT.forward`` slices the rotary tables (``cos``, ``sin``, buffers of the GPT itself) once at the top and passes
them, with the mask (None: causal), to every block; between pipeline stages only the hidden state travels. So a
forward pre-hook on each block, when the block is called with the hidden state alone (a pipeline stage's call;
``GPT.forward`` always passes six arguments), rebuilds them from the model's own buffers, as ``GPT.forward`` does
without a KV cache. Parameter names stay LitGPT's.
"""

from __future__ import annotations

from torch import nn

_HOOKED = "_lightning_parallel_pipeline_hooks"


def _block_inputs(model: nn.Module, block_idx: int):
    """Pre-hook: what ``GPT.forward`` passes block ``block_idx`` (training, no KV cache), from the hidden state."""

    def hook(block: nn.Module, args: tuple) -> tuple | None:
        if len(args) != 1:
            return None  # GPT.forward's own call passes everything itself
        x = args[0]  # (B, T, C)
        T = x.shape[1]
        if T > model.max_seq_length:  # GPT.forward's own check: the rotary tables stop there
            raise ValueError(f"Cannot forward sequence of length {T}, max seq length is only {model.max_seq_length}.")
        cos, sin = model.cos[:T].unsqueeze(0), model.sin[:T].unsqueeze(0)  # (1, T, rope_n_elem)
        indices = model.config.rope_indices
        if indices is not None:
            cos, sin = cos[..., indices[block_idx]], sin[..., indices[block_idx]]
        return (x, cos, sin, None, None, None)

    return hook


def _refuse_extra_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs or len(args) != 1:
        raise TypeError("Under pp > 1 the model takes input_ids alone (the pipeline passes one tensor): use pp=1.")


def litgpt_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """A LitGPT ``GPT``'s layers in forward order, for ``pipeline_layers()``: ``transformer.wte``, each block of
    ``transformer.h``, ``transformer.ln_f``, ``lm_head``. Each runs on the previous one's output alone (hooks
    rebuild the rotary tables); under ``GPT.forward`` the hooks do nothing. Idempotent.

    ``GPT.forward``'s embedding scaling and final logit softcapping are not layers: models using them are
    refused under pp > 1 by :func:`~lightning_parallel.litgpt.check_litgpt_degrees`.

    Args:
        model: the ``GPT`` (its modules are returned, so they must be registered in your LightningModule).
    """
    base = model.transformer
    if not getattr(model, _HOOKED, False):
        base.wte.register_forward_pre_hook(_refuse_extra_inputs, with_kwargs=True)
        for i, block in enumerate(base.h):
            block.register_forward_pre_hook(_block_inputs(model, i))
        setattr(model, _HOOKED, True)
    return [base.wte, *base.h, base.ln_f, model.lm_head]
