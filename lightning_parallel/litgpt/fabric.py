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

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_parallel.litgpt.plan import LitLoRAParallel, litgpt_tensor_parallel_plan


def litgpt_protocol(model: nn.Module) -> None:
    """Give LitGPT's ``GPT`` (as the scripts build it) the tensor-parallel plan, on the instance: the plan of
    :func:`~lightning_parallel.litgpt.plan.litgpt_tensor_parallel_plan` with the logits gathered whole (the scripts
    compute their loss on plain logits). A ``prepare_model`` of the Fabric strategies; ZeRO alone needs nothing."""
    if callable(getattr(model, "tensor_parallel_plan", None)):
        return

    def tensor_parallel_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        plan = litgpt_tensor_parallel_plan(model, sequence_parallel)
        head = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Replicate())
        plan["lm_head"] = LitLoRAParallel(head) if isinstance(plan["lm_head"], LitLoRAParallel) else head
        return plan

    model.tensor_parallel_plan = tensor_parallel_plan  # type: ignore[assignment]
