"""What a model must look like for its images to be split into strips, checked without any process group (the
model's shapes traced on the meta device, nothing computed). Pure torch.

Which modules see strips is structural: everything outside the ``gather`` modules (the classifier, whose input is
gathered from the strips) runs on strips. There every ``nn.Conv2d`` gets a halo (:func:`conv_halo`), every BatchNorm
reduces its statistics over the spatial group, and every pool must keep the strips aligned: kernel = stride, no
padding, and each strip's height a multiple of the stride. :func:`trace_heights` runs the model once on a meta copy of
an example batch and checks each of those against the image height; the smallest multiple of the height that passes is
``spatial`` x the downsampling before the classifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightning_parallel._compat import TorchDispatchMode
from lightning_parallel.parallel.spatial.split import HEIGHT, check_height

aten = torch.ops.aten
APPLIED = "_spatial_parallel"  # the attribute apply_spatial_parallel leaves on the model: what it did
_POOLS = {aten.max_pool2d_with_indices.default: "max_pool2d", aten.avg_pool2d.default: "avg_pool2d"}
# ops that mix rows in ways a strip cannot reproduce alone: gather the strips before them
_MIXING = ("_adaptive_avg_pool2d", "adaptive_max_pool2d", "upsample_", "grid_sampler", "fractional_max_pool2d")
_MIXING += ("native_group_norm",)
_REDUCTIONS = ("mean", "sum", "amax", "amin")


def _pair(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[-1]))


def conv_halo(conv: nn.Conv2d) -> tuple[int, int]:
    """(top, bottom): rows a strip of ``conv``'s input needs from above and below so that, convolved without height
    padding, it gives exactly its own output rows. Output row i reads input rows i*s - p to i*s - p + d(k-1); a strip
    of h rows (s divides h) owns outputs h/s: top = p, bottom = d(k-1) - p - (s - 1) (rows past the strip's last
    window; none when negative: the convolution floors)."""
    k, s, d = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
    reach = d * (k - 1)
    if isinstance(conv.padding, str):
        top = 0 if conv.padding == "valid" else reach // 2  # "same": torch puts the odd row at the bottom
    else:
        top = conv.padding[0]
    return top, max(0, reach - top - (s - 1))


def strip_modules(root: nn.Module, gather: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The modules of ``root`` that run on strips: all but the ``gather`` modules and what is inside them."""
    inside = tuple(f"{path}." for path in gather)
    return [(n, m) for n, m in root.named_modules() if n not in gather and not n.startswith(inside)]


def check_spatial_modules(root: nn.Module, spatial: int, gather: Sequence[str]) -> list[tuple[str, nn.Conv2d]]:
    """The strip convolutions of ``root``; a TypeError or ValueError naming the fix when there are none, a gather
    module is missing, or a convolution pads other than with zeros."""
    names = {n for n, _ in root.named_modules()}
    missing = [p for p in gather if p not in names]
    if missing or not gather:
        raise ValueError(
            f"spatial={spatial}: spatial_gather_modules() names {missing or 'no module'}, and the strips must be "
            f"gathered before a module of {type(root).__name__} (the classifier that flattens the feature maps): "
            "return its path (LitVGG: ['model.head'])."
        )
    convs = [(n, m) for n, m in strip_modules(root, gather) if isinstance(m, nn.Conv2d)]
    if not convs:
        raise TypeError(
            f"spatial={spatial} splits the images of convolutions (nn.Conv2d) over ranks, and {type(root).__name__} "
            "has none before its classifier: nothing would be split. Set spatial=1 (use dp, tp or cp instead)."
        )
    for name, conv in convs:
        if conv.padding_mode != "zeros":
            raise ValueError(
                f"spatial={spatial}: {name} pads with {conv.padding_mode!r}, and a strip's halo reproduces only zero "
                "padding at the image's edges. Use padding_mode='zeros', or spatial=1."
            )
    return convs


@dataclass
class HeightTrace:
    """What :func:`trace_heights` saw: the first problem found (None: fits), and the total downsampling."""

    problem: str | None = None
    downsampling: int = 1
    # (path, downsampling before it, halo rows) of each strip convolution
    convs: list[tuple[str, int, tuple[int, int]]] = field(default_factory=list)


class _Tracer(TorchDispatchMode):
    """Notes each pool and height-mixing op on the way to the first gather module (where the trace stops)."""

    def __init__(self, spatial: int, trace: HeightTrace) -> None:
        super().__init__()
        self.spatial, self.trace = spatial, trace
        self.in_conv = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        x = args[0] if args else None
        if self.trace.problem or not (isinstance(x, Tensor) and x.dim() == 4):
            return out
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if func in _POOLS:
            self._pool(_POOLS[func], args)
        elif func is aten.convolution.default and not self.in_conv:
            self.trace.problem = "a convolution that is not an nn.Conv2d module (F.conv2d) gets no halo rows"
        elif name.startswith(_MIXING) or (name.split(".")[0] in _REDUCTIONS and _reduces_height(args)):
            self.trace.problem = f"{name} mixes rows across the strips"
        return out

    def _pool(self, name: str, args: tuple) -> None:
        kernel = _pair(args[1])[0]
        stride = _pair(args[2])[0] if len(args) > 2 and args[2] else kernel
        padding = _pair(args[3])[0] if len(args) > 3 else 0
        if kernel != stride or padding:
            self.trace.problem = (
                f"{name} with kernel {kernel}, stride {stride}, padding {padding} (needs kernel = stride)"
            )
        self.trace.downsampling *= stride


def _reduces_height(args: tuple) -> bool:
    dims = args[1] if len(args) > 1 else None
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return any(d % 4 == HEIGHT for d in dims)


def trace_heights(root: nn.Module, example: Tensor, spatial: int, gather: Sequence[str]) -> HeightTrace:
    """Run ``root`` on a meta copy of ``example`` (whole (B, C, H, W) images; parameters and buffers swapped for meta
    tensors: nothing is computed or changed) and check every strip operation against ``spatial`` strips."""
    trace = HeightTrace()
    tracer = _Tracer(spatial, trace)
    gather_set = set(gather)
    handles = []
    for name, module in root.named_modules():
        if name in gather_set:
            handles.append(module.register_forward_pre_hook(lambda m, a: _enter(tracer)))
        elif isinstance(module, nn.Conv2d):
            handles.append(module.register_forward_pre_hook(_conv_hook(tracer, name, module, trace)))
            handles.append(module.register_forward_hook(partial(_conv_done, tracer, name, trace)))
    tensors = [*root.named_parameters(), *root.named_buffers()]
    state = {n: torch.empty_like(t, device="meta") for n, t in tensors if not is_lazy(t)}
    training = {m: m.training for m in root.modules()}
    root.eval()  # BatchNorm on running statistics: no batch reduction to mistake for a row mix, no collective
    try:
        with tracer:
            torch.func.functional_call(root, state, (example.to("meta"),))
    except _Gathered:
        pass
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in training.items():
            module.training = mode
    return trace


class _Gathered(Exception):
    """Raised at the first gather module: what runs on whole images after it is not the trace's concern."""


def _enter(tracer: _Tracer) -> None:
    raise _Gathered


def _conv_hook(tracer: _Tracer, name: str, conv: nn.Conv2d, trace: HeightTrace) -> Any:
    def hook(module: nn.Module, args: tuple) -> None:
        tracer.in_conv = True
        trace.convs.append((name, trace.downsampling, conv_halo(conv)))
        trace.downsampling *= conv.stride[0]

    return hook


def _conv_done(tracer: _Tracer, name: str, trace: HeightTrace, conv: nn.Module, args: tuple, out: Tensor) -> None:
    tracer.in_conv = False
    height, stride = args[0].shape[HEIGHT], conv.stride[0]
    if out.shape[HEIGHT] * stride != height and not trace.problem:
        trace.problem = (
            f"{name} turns height {height} into {out.shape[HEIGHT]} (not {height} / stride {stride}: its padding "
            f"{conv.padding} does not keep the size), so the strips' outputs would not be equal; pad it to keep the "
            "size (padding=kernel_size // 2)"
        )


def check_spatial_layout(root: nn.Module, spatial: int, gather: Sequence[str], example: Any = None) -> int:
    """Before launch: ``root`` has strip convolutions and, when ``example`` is a (B, C, H, W) batch, every strip
    operation keeps the strips aligned at its height (a ValueError or TypeError naming the setting and the fix).

    Returns:
        the multiple of the image height that every batch must be (spatial x the downsampling; ``spatial`` without
        an example).
    """
    applied = getattr(root, APPLIED, None)
    if applied is not None:  # switched to strips already (a validate after fit): checked then, and not traceable now
        return applied.multiple
    check_spatial_modules(root, spatial, gather)
    if not (isinstance(example, Tensor) and example.dim() == 4):
        return spatial
    trace = trace_heights(root, example, spatial, gather)
    if trace.problem is not None:
        raise ValueError(
            f"spatial={spatial}: {trace.problem}, so the strips would not give the one-process result. Gather the "
            "strips before it (spatial_gather_modules()), or set spatial=1."
        )
    height = example.shape[HEIGHT]
    multiple = spatial * trace.downsampling
    check_height(height, multiple, spatial)
    check_halos(trace, height, spatial)
    return multiple


def check_halos(trace: HeightTrace, height: int, spatial: int) -> None:
    """Each convolution's halo comes from the neighbouring strip alone: at most a strip's height of rows."""
    for name, down, (top, bottom) in trace.convs:
        strip = height // down // spatial  # this convolution's input rows per strip
        if max(top, bottom) > strip:
            raise ValueError(
                f"spatial={spatial}: {name} needs {max(top, bottom)} rows from each neighbouring strip, and its strips "
                f"at image height {height} have {strip}: use a smaller spatial, or larger images."
            )
