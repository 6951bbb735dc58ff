"""LitGPT's own Fabric scripts (``litgpt.finetune.full``, ``litgpt.finetune.lora``, ``litgpt.pretrain``) under this
package's Fabric strategies.

The scripts' ``setup`` picks Lightning's FSDPStrategy or ModelParallelStrategy by hand and launches their ``main``;
everything after that is plain Fabric. So the scripts run unchanged but for the strategy: build the Fabric with ours
and launch the script's own ``main`` (see ``examples/litgpt_scripts.py``)::

    strategy = Hybrid3DFabricStrategy(tp=2, prepare_model=litgpt_protocol)
    fabric = L.Fabric(devices=2, strategy=strategy, precision="bf16-true")
    fabric.launch(litgpt.finetune.full.main, dp, False, seed, config, data, checkpoint_dir, out_dir, train, eval,
                  "AdamW")

``dp`` is what the script calls ``devices``: the data-parallel ranks (its gradient accumulation divides the global
batch by it). Nothing needs to pass LitGPT's ``isinstance`` checks: their fallback (``model.load_state_dict`` of the
whole ``lit_model.pth``) loads into any layout here (:mod:`lightning_parallel.fabric.full_state`), and
``fabric.save`` writes this package's sharded folder (at the script's ``.../lit_model.pth`` path, a folder:
``python -m lightning_parallel.checkpoint consolidate`` makes it one file).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_parallel.litgpt.plan import LitLoRAParallel, litgpt_tensor_parallel_plan


def litgpt_protocol(model: nn.Module) -> None:
    """Give LitGPT's ``GPT`` (as the scripts build it) the tensor-parallel plan, on the instance: the plan of
    :func:`~lightning_parallel.litgpt.plan.litgpt_tensor_parallel_plan` with the logits gathered whole (the scripts
    compute their loss on plain logits), and a LoRA ``GPT`` built on the meta device the draws of one process
    (:func:`replay_discarded_draws`). A ``prepare_model`` of the Fabric strategies."""
    replay_discarded_draws(model)
    if callable(getattr(model, "tensor_parallel_plan", None)):
        return

    def tensor_parallel_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        plan = litgpt_tensor_parallel_plan(model, sequence_parallel)
        head = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Replicate())
        plan["lm_head"] = LitLoRAParallel(head) if isinstance(plan["lm_head"], LitLoRAParallel) else head
        return plan

    model.tensor_parallel_plan = tensor_parallel_plan  # type: ignore[assignment]


def hyperparameters_writer(**values: Any) -> Callable[[Callable, Path], None]:
    """A stand-in for LitGPT's ``save_hyperparameters(setup, folder)`` when its script's ``main`` is launched from
    Python rather than its CLI (the original parses ``sys.argv`` as the CLI's, with jsonargparse): writes
    ``folder/hyperparameters.yaml`` with ``values``, the ``setup`` arguments that LitGPT's later steps read back
    (``merge_lora`` reads the ``lora_*`` ones, ``checkpoint_dir`` and ``precision``)::

        litgpt.finetune.lora.save_hyperparameters = hyperparameters_writer(checkpoint_dir=folder, lora_r=8, ...)

    Args:
        **values: the ``setup`` arguments, by name (paths are written as strings).
    """
    plain = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}

    def save_hyperparameters(function: Callable, checkpoint_dir: Path) -> None:
        (Path(checkpoint_dir) / "hyperparameters.yaml").write_text(yaml.safe_dump(plain))

    return save_hyperparameters


def replay_discarded_draws(model: nn.Module) -> None:
    """Make a ``litgpt.lora.GPT`` built on the meta device get the values one process draws for it.

    Once split, each module's ``reset_parameters()`` fills its pieces, replaying the CPU generator from where the
    build began (:mod:`lightning_parallel.parallel.materialize`). LitGPT's LoRA ``Block`` first runs the base
    ``Block.__init__`` (a plain attention and an MLP, drawing their weights), then replaces its attention with a LoRA
    one whose ``__init__`` first runs the plain attention's (drawing again), and its MLP: one process's later draws
    come after all those. The first unit of each block, ``attn.qkv.linear``, makes those throwaway modules again (on
    the host, one block at a time, with LitGPT's own classes) before drawing its own values. A model with real
    tensors, or not a LoRA ``GPT``, is left as it is.
    """
    from litgpt import lora
    from litgpt.model import Block, CausalSelfAttention

    if not isinstance(model, lora.GPT) or not model.lm_head.linear.weight.is_meta:
        return
    for index, block in enumerate(model.transformer.h):
        target = block.attn.qkv.linear
        if getattr(target.reset_parameters, "replays_discarded", False):
            continue

        def reset_parameters(own=target.reset_parameters, index=index, dtype=target.weight.dtype) -> None:
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device("cpu"):
                    Block(model.config, index)  # what lora.Block's super().__init__ draws, then replaces
                    CausalSelfAttention(model.config, index)  # what lora.CausalSelfAttention's draws, then replaces
            finally:
                torch.set_default_dtype(default)
            own()

        reset_parameters.replays_discarded = True  # type: ignore[attr-defined]
        target.reset_parameters = reset_parameters  # type: ignore[method-assign]
