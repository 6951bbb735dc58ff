"""Every private torch and Lightning API this package touches, in one place.

When torch or Lightning moves one of these, this module (and ``tests/test_compat.py``, which resolves every
entry) is where it shows, not fifteen files. Public names are re-exported without the leading underscore.

Torch's entries are imported at once (``lightning_parallel.parallel`` uses them and stays Lightning-free);
Lightning's are imported the first time they are asked for (``from lightning_parallel._compat import
SubprocessScriptLauncher`` works through the module ``__getattr__`` below).

Pinned against torch 2.13 and Lightning 2.6 (pyproject.toml). torch 2.11 (a lent GPU machine's image) is bridged
where it differs: each such entry names both versions, and on 2.13 it is the 2.13 API itself.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: F401  (URL folders)
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401  (hf: fused qkv)
from torch.utils._python_dispatch import (
    TorchDispatchMode,  # noqa: F401  (semi-public: documented, underscored)
    is_in_torch_dispatch_mode,  # noqa: F401  (compile_layers: modes run eager)
)
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: F401
from torch.utils._pytree import tree_leaves, tree_map  # noqa: F401

# ----- torch -----

# The simulator (lightning_parallel/simulate): tensors with shapes and no memory, and torch's memory tracker over
# them (both underscored modules of torch 2.13); imported when asked for, so `import lightning_parallel` stays light.


def fake_tensor_mode(**kwargs: Any) -> Any:
    """``torch._subclasses.fake_tensor.FakeTensorMode(**kwargs)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake_tensor(tensor: Any) -> bool:
    """``torch._subclasses.fake_tensor.is_fake(tensor)``: a fake tensor (shapes, no values), or a wrapper of one."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def resolve_group(name: str) -> Any:
    """The process group of that name (functional collectives name their groups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def mem_tracker() -> Any:
    """``torch.distributed._tools.mem_tracker.MemTracker()``: tensor memory by kind, peak included; one that
    follows frozen parameters too (LoRA's base): torch's registers a gradient hook on every parameter a module's
    forward meets, which raises on one that does not require gradients. Here a frozen parameter is counted as a
    parameter and given no hook (it gets no gradient to count)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            for param in module.parameters():
                if not param.requires_grad:  # marked as hooked already: torch's loop skips the hook
                    self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenAwareMemTracker()


class _NoHook:
    """A removable handle that stands for a hook not registered."""

    def remove(self) -> None:
        return None


_NO_HOOK = _NoHook()


# ----- torchao (the fp8 extra) -----
# torchao 0.18's float8 training tensor dispatches each op through its table ``float8_ops.FLOAT8_OPS_TABLE`` (op ->
# handler(aten_op, args, kwargs)); its all-gather entries are where a float8 collective goes (parallel/float8.py
# sends them as uint8 on the host, where gloo refuses float8). Imported when asked for: torchao is optional.


def float8_gather_ops() -> tuple[dict, list[Any]]:
    """torchao's float8 op table and its all-gather ops (functional collectives, both namespaces)."""
    from torchao.float8 import float8_ops

    ops = [float8_ops.c10d_functional.all_gather_into_tensor.default]
    ops.append(float8_ops._c10d_functional.all_gather_into_tensor.default)
    return float8_ops.FLOAT8_OPS_TABLE, ops


def float8_grouped_mm() -> Any:
    """torchao 0.18's rowwise float8 grouped GEMM, ``_to_fp8_rowwise_then_scaled_grouped_mm(A, B_t, offs, out_dtype,
    float8_dtype, pad_token_groups_for_grouped_mm)`` (prototype, CUDA only: parallel/float8_experts.py)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm


# Even collectives into / out of one flat tensor (public API). torch 2.13 names them ``all_gather_single`` and
# ``reduce_scatter_single`` (the old names warn: deprecated); torch 2.11 has only ``all_gather_into_tensor`` and
# ``reduce_scatter_tensor``, with the same arguments. Looked up at each call, so whatever wraps torch's own (a
# communication counter, a test's spy) sees the call.


def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


# ``torch.Tensor`` subclasses that must not intercept torch functions (DCP's chunked views)
disabled_torch_function_impl = torch._C._disabled_torch_function_impl

# The ``PipelineStage`` method that runs once torch has inferred a stage's shapes by running it on placeholder
# inputs. torch 2.13: ``_post_metadata_inference_cleanup`` (a hook the schedule calls after metadata inference, run
# under ``fork_rng``). torch 2.11 has no such hook: ``_shape_inference`` (a no_grad forward on zeros, RNG not forked)
# is the method to wrap. :class:`ShapeInferenceHookStage` overrides whichever this torch has.
TORCH_2_13_PIPELINE_HOOK = hasattr(PipelineStage, "_post_metadata_inference_cleanup")
PIPELINE_STAGE_SHAPE_CLEANUP = "_post_metadata_inference_cleanup" if TORCH_2_13_PIPELINE_HOOK else "_shape_inference"


class ShapeInferenceHookStage(PipelineStage):
    """A ``PipelineStage`` that calls :meth:`after_shape_inference` once torch has inferred its shapes (torch runs the
    stage in train mode on placeholder inputs: a subclass restores what that run changed)."""

    def after_shape_inference(self) -> None:
        """Called once after each shape inference of this stage; a no-op here."""

    if TORCH_2_13_PIPELINE_HOOK:  # torch 2.13: the schedule calls the hook after forward and backward inference

        def _post_metadata_inference_cleanup(self) -> None:
            super()._post_metadata_inference_cleanup()
            self.after_shape_inference()

    else:  # torch 2.11: wrap the forward shape inference, and fork the RNG around it as 2.13's schedules do

        def _shape_inference(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
            if not self.is_first and self.stage_index_to_group_rank[self.stage_index - 1] != self.group_rank:
                # the step's inputs, given on every pp rank: 2.13 ignores them past the first stage, 2.11 refuses
                # them on a stage that receives its input shapes from another rank
                args = ()
            device = torch.device(self.device)
            devices = [device] if device.type != "cpu" else []
            with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
                outputs = super()._shape_inference(args, kwargs)
            self.after_shape_inference()
            return outputs

        def _get_init_p2p_neighbors_ops(self) -> list[Any]:
            # 2.11 warms up every neighbour link, a V schedule's stage pair on this very rank included: gloo
            # refuses a send to oneself ("Pair is not connected"); 2.13's warm-up skips those links
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


# torch 2.13's stages agree before their first step, over p2p, whether every stage was given its shapes (STATIC)
# or all infer them by running (DYNAMIC): the vote's two passes, run on every stage.
PIPELINE_WARMUP_VOTE = ("_warmup_forward_vote", "_warmup_backward_result") if TORCH_2_13_PIPELINE_HOOK else ()


class StaticVoteStage(ShapeInferenceHookStage):
    """A stage given its shapes statically, for a process group whose receives deliver nothing (torch's ``fake``
    backend): its warm-up vote's messages are still issued, their outcome read as STATIC (every stage of the run is
    given its shapes; a constant the schedule can read under ``FakeTensorMode``). torch 2.11 has no vote."""

    if PIPELINE_WARMUP_VOTE:

        def _warmup_forward_vote(self, has_backward: bool, received_acc: Tensor | None = None) -> Tensor:
            super()._warmup_forward_vote(has_backward, received_acc)
            return torch.tensor([1], dtype=torch.int32, device=self.device)

        def _warmup_backward_result(self, received_result: Tensor | None = None) -> Tensor:
            super()._warmup_backward_result(received_result)
            return torch.tensor([1], dtype=torch.int32, device=self.device)


def set_local_tensor(param: DTensor, local: Tensor) -> None:
    """Make a DTensor's shard *be* ``local`` (an alias, no copy): assigning ``.data`` would copy."""
    param._local_tensor = local


def local_tensor(t: Tensor) -> Tensor:
    """A DTensor's shard outside autograd (``to_local()`` records a graph node), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def in_backward() -> bool:
    """True while autograd's engine runs a backward (a checkpointed layer recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A multi-dimensional slice of a DeviceMesh as one dimension named ``name`` (torchtitan's ``dp_shard_cp``)."""
    return mesh._flatten(name)


def default_store() -> Any:
    """The default process group's key-value store (the TCPStore torchrun or the strategy set up)."""
    return torch.distributed.distributed_c10d._get_default_store()


def group_name_of(group: Any) -> str:
    """The name of a process group given as functional collectives name it (a name, a group or a mesh)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group).group_name


def resolve_process_group(group: Any) -> Any:
    """The process group named ``group`` (a name, or a group itself)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group)


def default_group() -> Any:
    """The default (world) process group."""
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group()


def funcol_group_name(group: Any) -> str:
    """The name of the process group a functional collective's ``group`` argument means (a group, a name, a list of
    ranks, a DeviceMesh or a (mesh, axis) pair)."""
    from torch.distributed._functional_collectives import _resolve_group_name

    return _resolve_group_name(group)


def group_size_of(group: Any) -> int:
    """Size of a process group given the way functional collectives name it (a name, a group or a mesh)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group).size()


def group_device_types(group: Any = None) -> list[str]:
    """The device types a process group has a backend for (gloo: ``cpu`` and ``cuda``; NCCL: ``cuda`` only)."""
    from torch.distributed.distributed_c10d import _device_capability

    return _device_capability(group)


def set_group_timeout(group: Any, timeout: Any) -> None:
    """Set a process group's collective timeout on every backend it has (NCCL, gloo alike), after it was built:
    generic backend options passed at creation are refused by NCCL's split."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def group_timeout(group: Any, device_type: str = "cpu") -> Any:
    """The collective timeout a process group's backend for ``device_type`` applies (what :func:`set_group_timeout`
    set)."""
    return group._get_backend(torch.device(device_type)).options._timeout


def process_groups() -> list[Any]:
    """Every process group this process has made and not destroyed, the world's included (torch's registry)."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def abort_process_group(group: Any = None) -> None:
    """Abort a process group's communicators: an NCCL collective waiting for a dead peer then fails instead of hanging
    until the watchdog's timeout (gloo ignores it: its collectives already fail when a peer's connection closes)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(group)


def group_sequence_numbers() -> dict[str, tuple[int, tuple[int, ...]]]:
    """Every process group of this process, by name: the collectives and point-to-point operations issued on it so far
    (torch's own counter, advanced by the thread that issues them: functional collectives and DTensor's included; on
    NCCL point-to-point operations have a counter of their own, not this one) and its global ranks. Safe to call from
    another thread while this one waits in a collective."""
    from torch.distributed import distributed_c10d as c10d

    found = {}
    for group, name in list(c10d._world.pg_names.items()):
        try:
            found[name] = (group._get_sequence_number_for_group(), tuple(c10d.get_process_group_ranks(group)))
        except (RuntimeError, ValueError):  # a group destroyed while we looked
            continue
    return found


def flight_recorder_dump(as_json: bool = False) -> bytes:
    """torch's flight recorder (every process group of this process, gloo's too when ``TORCH_FR_BUFFER_SIZE`` was set
    before the first group): a pickle for ``python -m torch.distributed.flight_recorder.fr_trace``, or JSON."""
    from torch._C import _distributed_c10d as c10d

    return c10d._dump_fr_trace_json() if as_json else c10d._dump_fr_trace()


# ----- Lightning (imported on first use) -----

_LIGHTNING = {
    "init_dist_connection": ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    "sync_ddp_if_available": ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available"),
    "distributed_is_initialized": ("lightning.fabric.utilities.distributed", "_distributed_is_initialized"),
    "default_process_group_backend_for_device": (
        "lightning.fabric.utilities.distributed",
        "_get_default_process_group_backend_for_device",
    ),
    "optimizers_to_device": ("lightning.fabric.utilities.optimizer", "_optimizers_to_device"),
    "set_num_threads_if_needed": ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed"),
    "SubprocessScriptLauncher": (
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _LIGHTNING:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LIGHTNING[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def lightning_entries() -> list[str]:
    """The Lightning names above (tests resolve every one)."""
    return list(_LIGHTNING)


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


def fit_combined_loader(trainer: Any) -> Any:
    """The fit loop's combined training loader (Lightning keeps no public handle on it)."""
    return trainer.fit_loop._combined_loader
