"""The recipe models as a Lightning user parallelizes them for Lightning's own ``ModelParallelStrategy``
(FSDP2 over the data-parallel axis, DTensor TP over the tensor-parallel axis): the benchmark's baselines.

Lightning leaves the parallelization to ``configure_model``; these subclasses do what Lightning's docs
show: the model's own TP plan with ``parallelize_module``, then ``fully_shard`` on every layer and the root.
With tp > 1 the head leaves logits sharded over the vocabulary, so the loss and its backward run under
``loss_parallel`` (the same vocabulary-parallel loss hybrid3d uses).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_parallel.models import GPTModule, LitVGG
from lightning_parallel.parallel.tensor.plan import apply_tp


def _parallelize(module: Any) -> None:
    mesh = module.device_mesh
    tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
    if tp_mesh.size() > 1:
        apply_tp(module, tp_mesh, module.tensor_parallel_plan(False))
    layers: list[nn.Module] = module.pipeline_layers()
    owners = Counter(id(p) for layer in layers for p in layer.parameters())
    for layer in layers:
        if all(owners[id(p)] == 1 for p in layer.parameters()):  # tied embedding and head stay with the root
            fully_shard(layer, mesh=dp_mesh)
    fully_shard(module.model, mesh=dp_mesh)


class _VocabParallelLoss:
    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        if not isinstance(logits, DTensor):
            return super().loss(logits, targets)
        with loss_parallel():
            value = super().loss(logits, targets)
        return value.full_tensor()  # a plain scalar for logging, as on one device

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        with loss_parallel():
            loss.backward(*args, **kwargs)


class ModelParallelGPT(_VocabParallelLoss, GPTModule):
    """LitGPT for ``ModelParallelStrategy``."""

    def configure_model(self) -> None:
        super().configure_model()
        _parallelize(self)


class ModelParallelVGG(LitVGG):
    """LitVGG for ``ModelParallelStrategy`` (data parallel only: the benchmark splits VGG by dp)."""

    def configure_model(self) -> None:
        super().configure_model()
        _parallelize(self)
