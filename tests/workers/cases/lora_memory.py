"""What a rank holds for a model with adapters on a frozen base, read from its tensors (cases/hf.py's case key
``memory``; tests/test_hf_lora_memory.py checks it): model-state bytes after the last step, every tensor a
backward gives a gradient to, and every gradient buffer held after backward and after the step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.measure.memory import model_state_bytes


def gradient_leaves(loss: Tensor) -> list[Tensor]:
    """The tensors ``loss.backward()`` accumulates a gradient into: the leaves of its autograd graph (under
    FSDP2 the gathered, unsharded parameters; their gradients are allocated whole before the reduce-scatter). A
    frozen weight among them would get a full-size gradient, however briefly."""
    leaves, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad
            leaves.append(node.variable)
        todo += [next_node for next_node, _ in node.next_functions]
    return leaves


def gradient_buffers(model: nn.Module, trainer: pl.Trainer) -> list[tuple[str, int, int]]:
    """(what, its storage's address, that storage's bytes) of every gradient tensor held now: each parameter's
    ``.grad`` (a frozen one's named ``frozen:<name>``) and each optimizer parameter's (ZeRO-1/2's slices: under
    ZeRO-1 a view of the flat gradient buffer, whose whole storage it names). Views of one buffer share its address."""
    held = [(f"{'adapter' if p.requires_grad else 'frozen'}:{n}", p.grad) for n, p in model.named_parameters()
            if p.grad is not None]  # fmt: skip
    own = {id(p) for p in model.parameters()}
    for optimizer in trainer.optimizers:
        held += [("optimizer slice", p.grad) for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None and id(p) not in own]  # fmt: skip
    storages = [(what, local(t).untyped_storage()) for what, t in held]
    return [(what, s.data_ptr(), s.nbytes()) for what, s in storages]


class LoraMemoryProbe(pl.Callback):
    """Records, on this rank: the gradient leaves of every backward (elements, dtypes), the gradient buffers
    after every backward and after the last step, and :func:`model_state_bytes` after the last step (before the
    next zero_grad), with the frozen parameters' own bytes apart."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step
        self.leaf_numels: list[int] = []  # per backward: elements of the tensors it gives gradients to
        self.leaf_dtypes: set[str] = set()
        self.after_backward: list[list[tuple[str, int]]] = []
        self.report: dict = {}

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        leaves = gradient_leaves(loss)
        self.leaf_numels.append(sum(t.numel() for t in leaves))  # a DTensor's whole size: tp-independent
        self.leaf_dtypes |= {str(t.dtype) for t in leaves}

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after_backward.append(gradient_buffers(pl_module, trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if trainer.global_step != self.last_step or self.report:
            return
        opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        frozen = [p for p in pl_module.parameters() if not p.requires_grad]
        self.report = {
            "states": model_state_bytes(trainer.strategy.model, opts),
            "frozen_bytes": sum(local(p).numel() * p.element_size() for p in frozen),
            "frozen_dtypes": sorted({str(p.dtype) for p in frozen}),
            "frozen_local_numel": sum(local(p).numel() for p in frozen),
            "adapter_local_numel": sum(local(p).numel() for p in pl_module.parameters() if p.requires_grad),
            "step_scalars": sum(
                1 for o in opts for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() == 0
            ),  # fmt: skip
            "after_step": gradient_buffers(pl_module, trainer),
        }

    def result(self) -> dict:
        return {"memory": {**self.report, "leaf_numels": self.leaf_numels, "leaf_dtypes": sorted(self.leaf_dtypes),
                           "after_backward": self.after_backward}}  # fmt: skip
