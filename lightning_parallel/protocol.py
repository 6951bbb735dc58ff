"""The bring-your-own-model protocol: what a module offers so a layout can split it.

Each method is optional and asked for only by the axis that needs it: ``pipeline_layers()`` and ``loss()``
under pp > 1, ``tensor_parallel_plan()`` under tp > 1, ``expert_parallel_plan()`` under ep > 1 (experts other than
``lightning_parallel.MoE``'s), ``context_parallel()`` and ``attention_heads()`` under cp > 1,
``spatial_gather_modules()`` under spatial > 1, ``check_parallel_degrees()`` always when present,
``materialize(device)`` once the model is split, when parameters are still on the meta device. The
strategies read them through the functions below, which raise the error that names what is missing; nothing
else looks methods up by name (``reset_parameters()`` included). Pure Python + torch types; the module need not be
a LightningModule.

Where a model's initial values come from when a layout shards its parameters (tp > 1, ZeRO-3, pp > 1):

- built on the host, outside any context (``model = MyModule(); trainer.fit(model)``, the usual case): the values
  it was built with. The host holds the whole model, as the user built it; the layout splits it on the meta device
  and each rank copies only its slices to its device (``parallel/materialize.py``). No accelerator ever holds it
  whole. With only ZeRO 0-2 and no tp or pp, parameters are whole on every rank by design and move there whole.
- built in ``configure_model()`` or under ``Trainer.init_module()``: on the meta device, so it is never whole
  anywhere; once split, ``materialize(device)`` fills it when the module has one (HFCausalLM reads its slices of a
  folder; HFCausalLM and LitGPTCausalLM of a config alone, built on meta by themselves, initialize each module they
  hold from its own seed: ``parallel/materialize.py``'s ``SeededInit``), else each :func:`reset_units` unit's
  ``reset_parameters()`` does, one unit at a time on the host, each rank keeping its slices: the values a single
  process gets when it builds the module on the host with the same seed (an init that only ``__init__`` runs,
  outside every ``reset_parameters()``, is not replayed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

if TYPE_CHECKING:
    from lightning_parallel.parallel.mesh import ParallelDims


@runtime_checkable
class Pipelined(Protocol):
    """Under pp > 1: the layers forward runs, in order (each takes the previous one's output, one tensor; the
    first takes the step's ``self(...)`` arguments), and the loss of one microbatch (a mean over its samples)."""

    def pipeline_layers(self) -> Sequence[nn.Module]: ...

    def loss(self, output: Any, target: Any) -> Tensor: ...


@runtime_checkable
class TensorParallel(Protocol):
    """Under tp > 1: module path (``*`` for one name) -> a torch ``ParallelStyle`` (or this package's conv styles)."""

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> Mapping[str, ParallelStyle]: ...


# causal attention over the whole sequence of this rank's pieces of it: (q, k, v, dropout_p=0.0, scale=None) -> out,
# each (B, H, T, D) with as many key/value heads as query heads (scale None: 1 / sqrt(D))
AttentionCore = Callable[..., Tensor]
# (T, device) -> (T,): the positions in the whole sequence of this rank's T tokens
Positions = Callable[[int, torch.device], Tensor]


@runtime_checkable
class ContextParallelModel(Protocol):
    """Under cp > 1 (each sequence split over the cp ranks, two chunks each): ``context_parallel`` points the model's
    causal attention at ``attention`` (ring or Ulysses over the cp group) and makes its positions (rotary or learned)
    with ``positions``, and returns the paths of the attention modules switched (those this rank holds: skip other
    pipeline stages' placeholders); ``attention_heads()`` is the query
    heads of one attention (Ulysses splits the heads each tp rank holds over cp)."""

    def context_parallel(self, attention: AttentionCore, positions: Positions) -> Sequence[str]: ...

    def attention_heads(self) -> int: ...


@runtime_checkable
class ExpertParallel(Protocol):
    """Under ep > 1, for experts that are not ``lightning_parallel.MoE`` layers (found by type): module path (``*``
    for one name) -> :class:`~lightning_parallel.parallel.expert.apply.ExpertStyle`."""

    def expert_parallel_plan(self) -> Mapping[str, Any]: ...


@runtime_checkable
class SpatialParallel(Protocol):
    """Under spatial > 1: the paths of the modules whose input is gathered from the image strips (the classifier that
    flattens the feature maps); every module outside them runs on strips."""

    def spatial_gather_modules(self) -> Sequence[str]: ...


@runtime_checkable
class ChecksDegrees(Protocol):
    """Optional: refuse degrees the model cannot split, before any process starts. ``dims`` is the whole layout,
    one frozen :class:`~lightning_parallel.parallel.mesh.ParallelDims` (``dims.pp``, ``dims.tp``, ``dims.cp``,
    ``dims.ep``, ``dims.dp``, ...): a model reads the axes it cares about, and a new axis reaches it with no change
    of signature."""

    def check_parallel_degrees(self, dims: ParallelDims) -> None: ...


@runtime_checkable
class Materializes(Protocol):
    """Optional: a module built with its parameters on the meta device gives them storage and values itself,
    once the model is split over the layout (pipeline stages kept, tensor and ZeRO-3 shards made), so each rank
    fills only what it holds (HFCausalLM reads its slices of a pretrained folder). Without it, tensors built on
    meta are initialized by the ``reset_parameters()`` of their :func:`reset_units`."""

    def materialize(self, device: torch.device) -> None: ...


@runtime_checkable
class ParallelModule(Pipelined, TensorParallel, Protocol):
    """A module that every layout can split: pipelined and tensor-parallel."""


def pipeline_layers(module: Any, pp: int) -> list[nn.Module]:
    """``module``'s pipeline layers, or a TypeError naming what pp > 1 needs."""
    require_pipelined(module, pp)
    return list(module.pipeline_layers())


def require_pipelined(module: Any, pp: int) -> None:
    """A TypeError naming what pp > 1 needs, unless ``module`` has ``pipeline_layers()`` and ``loss()``."""
    missing = [m for m in ("pipeline_layers", "loss") if not callable(getattr(module, m, None))]
    if missing:
        raise TypeError(
            f"pp={pp} needs {type(module).__name__}.{' and .'.join(missing)}(): pipeline_layers() returns "
            "the layers forward runs in order, loss(output, target) the loss. Add them (see docs/custom-models.md) or "
            "set pp=1."
        )


def tensor_parallel_plan(module: Any, tp: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """``module``'s tensor-parallel plan, or a TypeError naming what tp > 1 needs."""
    if not isinstance(module, TensorParallel):
        raise TypeError(
            f"tp={tp} needs {type(module).__name__}.tensor_parallel_plan(sequence_parallel) returning "
            "{module path: ParallelStyle}: add it (see docs/custom-models.md) or set tp=1."
        )
    return dict(module.tensor_parallel_plan(sequence_parallel))


def _require_context_parallel(module: Any, cp: int) -> None:
    if not isinstance(module, ContextParallelModel):
        raise TypeError(
            f"cp={cp} needs {type(module).__name__}.context_parallel(attention, positions) (point the model's "
            "causal attention at attention(q, k, v, dropout_p, scale) and its positions at positions(T, device), "
            "return the attention modules' paths) and .attention_heads() to attend across the split sequence: add "
            "them (see docs/context-parallel-models.md; the recipe GPT, HFCausalLM and LitGPTCausalLM have them), or "
            "set cp=1."
        )


def context_parallel(module: Any, cp: int, attention: AttentionCore, positions: Positions) -> list[str]:
    """Switch ``module``'s attention and positions to context parallelism; the attention modules switched (on this
    rank: under pp a stage may hold none).

    Raises:
        TypeError: ``module`` has no ``context_parallel``.
    """
    _require_context_parallel(module, cp)
    return list(module.context_parallel(attention, positions))


def attention_heads(module: Any, cp: int) -> int:
    """``module``'s query heads per attention, or the TypeError naming what cp > 1 needs."""
    _require_context_parallel(module, cp)
    return int(module.attention_heads())


def expert_parallel_plan(module: Any) -> dict[str, Any]:
    """``module``'s expert-parallel plan; empty when it has none (its ``MoE`` layers are found by type)."""
    return dict(module.expert_parallel_plan()) if isinstance(module, ExpertParallel) else {}


def spatial_gather_modules(module: Any, spatial: int) -> list[str]:
    """``module``'s gather points for spatial parallelism, or a TypeError naming what spatial > 1 needs."""
    if not isinstance(module, SpatialParallel):
        raise TypeError(
            f"spatial={spatial} needs {type(module).__name__}.spatial_gather_modules() returning the paths of the "
            "modules whose input is gathered from the image strips (the classifier; LitVGG: ['model.head']): add it "
            "or set spatial=1."
        )
    return list(module.spatial_gather_modules())


def check_parallel_degrees(module: Any, dims: ParallelDims) -> None:
    """Let the module refuse degrees it cannot split, when it has ``check_parallel_degrees(dims)``.

    A method of the earlier form (the degrees as keywords: ``check_parallel_degrees(self, pp, tp, cp=1, ep=1)``)
    still runs, with a FutureWarning naming the new form: :func:`_keyword_degrees`, the one place that knows it."""
    method = getattr(module, "check_parallel_degrees", None)
    if not callable(method):
        return
    try:
        method(dims=dims)
    except TypeError as error:
        if not _call_refused(error):
            raise  # raised inside the method: the model's own refusal, or its bug
        _keyword_degrees(module, method, dims)


def _call_refused(error: TypeError) -> bool:
    """Whether ``error`` came from the call itself (arguments the method does not take), not from inside it: the
    traceback stops at the caller's frame."""
    return error.__traceback__ is not None and error.__traceback__.tb_next is None


def _keyword_degrees(module: Any, method: Callable[..., None], dims: ParallelDims) -> None:
    """Deprecated: ``method`` takes the degrees as keywords (pp and tp, and cp and ep when it names them). Tried with
    the most it takes, as the earlier protocol passed them; to be removed with that form."""
    warnings.warn(
        f"{type(module).__name__}.check_parallel_degrees takes the degrees as keywords (pp=, tp=, ...): define "
        "check_parallel_degrees(self, dims) and read dims.pp, dims.tp, dims.cp, dims.ep (a ParallelDims). The keyword "
        "form is deprecated and will be removed.",
        FutureWarning,
        stacklevel=3,
    )
    base = {"pp": dims.pp, "tp": dims.tp}
    for extra in ({"cp": dims.cp, "ep": dims.ep}, {"cp": dims.cp}, {"ep": dims.ep}):
        try:
            return method(**base, **extra)
        except TypeError as error:
            if not _call_refused(error):
                raise
    method(**base)


def has_pipeline_layers(module: Any) -> bool:
    return callable(getattr(module, "pipeline_layers", None))


def has_loss(module: Any) -> bool:
    return callable(getattr(module, "loss", None))


def materializes_itself(module: Any) -> bool:
    return isinstance(module, Materializes)


def strategy_calls_materialize(strategy: Any) -> bool:
    """Whether ``strategy`` fills a split model's meta parameters through the module's ``materialize(device)``
    (this package's mesh strategies: their ``calls_materialize``); Lightning's own strategies do not, so a module
    that defers reading its weights reads them whole in ``configure_model`` there."""
    return bool(getattr(strategy, "calls_materialize", False))


def materialize(module: Any, root: nn.Module, device: torch.device) -> None:
    """Once the model is split: let ``module`` fill the meta parameters ``root`` still has, when it has a
    ``materialize(device)``."""
    if isinstance(module, Materializes) and any(p.is_meta for p in root.parameters()):
        module.materialize(device)


def require_materialized(module: Any, root: nn.Module) -> None:
    """A TypeError naming the parameters of ``root`` still on the meta device, and the fix."""
    left = [name for name, p in root.named_parameters() if p.is_meta]
    if left:
        raise TypeError(
            f"{type(module).__name__}'s parameters {left[:3]} are still on the meta device once the model is split: "
            "give the module a materialize(device) that fills them, or build them on a real device."
        )


def _resettable(module: Any) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def reset_units(module: Any, root: nn.Module, names: set[str]) -> list[tuple[str, nn.Module]]:
    """The modules whose ``reset_parameters()`` initialize the tensors ``names`` of ``root`` (built on the meta
    device), as (path, module) in ``root``'s module order, a unit after the units inside it: the pipeline layer
    holding a tensor when ``module`` has ``pipeline_layers()`` and that layer a ``reset_parameters()`` (the GPT's
    layers seed their own draws), else the module owning it (``nn.Linear``'s own init, as Lightning's meta-device
    materialization does).

    Raises:
        TypeError: a tensor whose owner has no ``reset_parameters()`` (naming it and the fix).
    """
    paths = {id(m): path for path, m in root.named_modules()}
    layers = []
    if has_pipeline_layers(module):
        layers = [paths[id(layer)] for layer in module.pipeline_layers() if id(layer) in paths and _resettable(layer)]
    units: dict[str, nn.Module] = {}
    orphans = []
    for name in names:
        owner = name.rpartition(".")[0]
        layer = next((p for p in layers if p and (owner == p or owner.startswith(p + "."))), None)
        path = layer if layer is not None else owner
        unit = root.get_submodule(path)
        if _resettable(unit):
            units[path] = unit
        else:
            orphans.append(name)
    if orphans:
        owner = type(root.get_submodule(sorted(orphans)[0].rpartition(".")[0])).__name__
        raise TypeError(
            f"{type(module).__name__}'s {sorted(orphans)[:3]} are built on the meta device (configure_model or "
            f"Trainer.init_module() under a layout that shards parameters) and {owner} has no reset_parameters() "
            "to initialize them once the model is split: give it one that fills all its tensors (or return the layer "
            "holding them from pipeline_layers(), with a reset_parameters()), give the module a materialize(device), "
            "or build the model in __init__."
        )
    order = _post_order(root)  # a unit after the units inside it: modules draw their own tensors after children's
    return sorted(units.items(), key=lambda item: order.get(item[0], len(order)))


def _post_order(root: nn.Module, prefix: str = "") -> dict[str, int]:
    """Module paths of ``root``, each after its children: a module's ``__init__`` builds its submodules (each drawing
    its values) before its own ``reset_parameters()`` draws (LitGPT's ``LoRALinear``: its ``linear``, then its
    ``lora_A``)."""
    order: dict[str, int] = {}
    for name, child in root.named_children():
        for path in _post_order(child, f"{prefix}{name}."):
            order.setdefault(path, len(order))
    order.setdefault(prefix[:-1], len(order))
    return order


def unfilled_error(module: Any, root: nn.Module, names: list[str]) -> TypeError:
    """The error for tensors built on meta that their unit's ``reset_parameters()`` ran but did not fill."""
    return TypeError(
        f"{type(module).__name__}'s {names[:3]} are built on the meta device and the reset_parameters() that should "
        "initialize them once the model is split left them unwritten: make reset_parameters() fill every tensor of "
        "its module (buffers included), give the module a materialize(device), or build the model in __init__."
    )
