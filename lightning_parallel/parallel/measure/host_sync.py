"""Host synchronisations counted on a CPU run: every call that, were the run's tensors on a GPU, would make the
host wait for the device (or a blocking copy to it), with the source line that made it. Pure torch.

On a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` (or ``"error"``) is the check: CUDA itself reports each
synchronising call. A CPU build has no device to wait for, so here every tensor counts as a device tensor except
the ones that stay on the host on a GPU too:

- tensors a factory makes without a ``device`` (``torch.arange(n)``, ``torch.tensor(x)``, ``torch.zeros(1)``) or
  with the string ``"cpu"``, and whatever is computed from such tensors alone (a ``torch.device`` object counts as
  the run's device: on a CPU run ``trainer.strategy.root_device`` is ``cpu``);
- torch optimizers' ``step`` counters (host tensors unless ``capturable`` or ``fused``) and DeviceMeshes' rank
  tables, found when counting starts.

Counted, each as one event (:class:`SyncEvent`):

========================  ============================================================================
kind                      what
========================  ============================================================================
``item``                  ``.item()``, ``int()``, ``float()``, ``bool()``, ``.tolist()``, ``.numpy()``,
                          ``torch.equal``/``allclose`` of a device tensor; a scalar read inside torch
                          (``aten::_local_scalar_dense``)
``to_host``               ``.cpu()`` or ``.to("cpu")`` of a device tensor
``data_dependent_shape``  an output whose shape depends on the values: ``nonzero``, ``masked_select``,
                          ``unique``, ``repeat_interleave`` without ``output_size``, boolean-mask indexing
                          (not ``x[mask] = scalar``: torch runs that as ``masked_fill_``)
``host_to_device``        a host tensor copied to the device (``.to(device)``, ``copy_``), or
                          ``torch.tensor(data, device=...)`` (host data, a blocking copy)
========================  ============================================================================

A :class:`torch.overrides.TorchFunctionMode` sees the Python-level calls (and tracks which tensors are host
ones); a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees what torch does inside its own functions
(scalar reads and data-dependent shapes at the operator level). Each event names its source: the innermost frame
outside torch (``file:line``) and the package it is in (``lightning_parallel``, ``lightning``, ``torch``, other).
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

READS = {"item", "__int__", "__float__", "__bool__", "__index__", "__complex__", "tolist", "numpy"}
READS |= {"equal", "allclose", "is_nonzero"}
FACTORIES = {"tensor", "as_tensor", "arange", "range", "zeros", "ones", "full", "empty", "rand", "randn"}
FACTORIES |= {"randint", "linspace", "logspace", "eye", "scalar_tensor", "randperm", "from_numpy"}
_aten = torch.ops.aten
DATA_DEPENDENT = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
PACKAGES = ("lightning_parallel", "lightning", "torch")
_MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")  # other counters' modes: never a call's source


@dataclass(frozen=True)
class SyncEvent:
    """One synchronising call: its kind (see the module's table), the call (``Tensor.item``, ``aten.nonzero``),
    where it came from (``file:line``, the innermost frame outside torch), that file's package, and the caller of
    that frame (``via``: which of a helper's callers it was)."""

    kind: str
    call: str
    site: str
    package: str
    via: str


def _package(filename: str) -> str:
    for name in PACKAGES:
        if f"{os.sep}{name}{os.sep}" in filename:
            return name
    return "other"


def _outside_torch(frame: Any) -> Any:
    """The first frame from ``frame`` outward that is not torch's, this module's or a mode's hook (None: none)."""
    while frame is not None:
        name = frame.f_code.co_filename
        mine = os.path.abspath(name) == _HERE or frame.f_code.co_name in _MODE_HOOKS
        if not mine and not name.startswith(_TORCH_DIR):
            return frame
        frame = frame.f_back
    return None


def _where(frame: Any) -> str:
    short = frame.f_code.co_filename.split(f"{os.sep}site-packages{os.sep}")[-1]
    for package in PACKAGES:  # from the package's folder on: the same on every checkout
        marker = f"{os.sep}{package}{os.sep}"
        if marker in short:
            short = package + os.sep + short.rsplit(marker, 1)[-1]
            break
    return f"{short}:{frame.f_lineno}"


def _site() -> tuple[str, str, str]:
    """(``file:line``, the package, its caller's ``file:line``) of the innermost frame outside torch and this
    module (``?`` if none)."""
    frame = _outside_torch(sys._getframe(2))
    if frame is None:
        return "?", "torch", "?"
    caller = _outside_torch(frame.f_back)
    return _where(frame), _package(frame.f_code.co_filename), _where(caller) if caller is not None else "?"


def _is_cpu_string(value: Any) -> bool:
    return isinstance(value, str) and value.split(":")[0] == "cpu"


def _target_device(args: tuple, kwargs: dict) -> Any:
    """The device a ``Tensor.to``/``cuda`` call moves to (None: a dtype-only ``to``)."""
    if "device" in kwargs:
        return kwargs["device"]
    for value in args[1:]:
        if isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
            return value
        if isinstance(value, torch.Tensor):
            return value.device
    return None


class HostSyncCounter:
    """Counts the host synchronisations (:class:`SyncEvent`) of the code run inside it; ``events`` lists them.

    Usage::

        with HostSyncCounter() as counter:
            loss = model(x).sum(); loss.backward(); optimizer.step()
        counter.by_site()   # {(kind, site, package): calls}
    """

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors that stay on the host on a GPU
        self._inside = 0  # inside a Python-level read already counted: the operator it runs is not counted again
        self._function = _FunctionMode(self)
        self._dispatch = _DispatchMode(self)

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self._host

    def mark_host(self, t: Any) -> None:
        for leaf in tree_leaves(t):
            if isinstance(leaf, torch.Tensor):
                self._host[leaf] = True

    def record(self, kind: str, call: str) -> None:
        site, package, via = _site()
        self.events.append(SyncEvent(kind, call, site, package, via))

    def __enter__(self) -> HostSyncCounter:
        for tensor in _host_tensors():
            self._host[tensor] = True
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)

    def by_site(self) -> Counter:
        """Calls per (kind, site, package, via)."""
        return Counter((e.kind, e.site, e.package, e.via) for e in self.events)


def _host_tensors() -> list[torch.Tensor]:
    """The live tensors that stay on the host on a GPU: every torch optimizer's ``step`` counters unless it is
    capturable or fused, and every DeviceMesh's rank tables (CPU tensors whatever the device)."""
    from torch.distributed.device_mesh import DeviceMesh

    with warnings.catch_warnings():  # isinstance on every live object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        live = [obj for obj in gc.get_objects() if isinstance(obj, (torch.optim.Optimizer, DeviceMesh))]
    meshes = [vars(obj).values() for obj in live if isinstance(obj, DeviceMesh)]
    host = [value for values in meshes for value in values if isinstance(value, torch.Tensor)]
    for obj in live:
        if not isinstance(obj, torch.optim.Optimizer) or obj.defaults.get("capturable") or obj.defaults.get("fused"):
            continue
        for state in obj.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor):
                host.append(step)
    return host


class _FunctionMode(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        counter, name = self.counter, getattr(func, "__name__", "")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        all_host = bool(tensors) and all(counter.is_host(t) for t in tensors)
        to_host = name == "cpu" or (name == "to" and _is_cpu_string(_target_device(args, kwargs)))
        if (name in READS or to_host) and tensors and not all_host:
            counter.record("to_host" if to_host else "item", f"Tensor.{name}")
            counter._inside += 1
            try:
                out = func(*args, **kwargs)
            finally:
                counter._inside -= 1
            if to_host and not any(out is t for t in tensors):  # on a CPU run .cpu() returns the tensor itself
                counter.mark_host(out)
            return out
        out = func(*args, **kwargs)
        if name in FACTORIES and not tensors:
            device = kwargs.get("device")
            if device is None or _is_cpu_string(device):
                counter.mark_host(out)
            elif name in ("tensor", "as_tensor"):
                counter.record("host_to_device", f"torch.{name}(device=...)")
        elif name in ("to", "cuda") and all_host:
            device = _target_device(args, kwargs)
            if device is None or _is_cpu_string(device):
                counter.mark_host(out)  # a dtype change, or to the host: stays there
            else:
                counter.record("host_to_device", f"Tensor.{name}")
        elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            if counter.is_host(args[1]) and not counter.is_host(args[0]):
                counter.record("host_to_device", "Tensor.copy_")
        elif all_host:
            counter.mark_host(out)
        return out


class _DispatchMode(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        counter = self.counter
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = bool(tensors) and not all(counter.is_host(t) for t in tensors)
        if on_device and not counter._inside:
            if func is _aten._local_scalar_dense.default:
                counter.record("item", "aten._local_scalar_dense")
            elif func in DATA_DEPENDENT or _data_dependent(func, args, kwargs):
                counter.record("data_dependent_shape", f"aten.{func.__name__}")
        return func(*args, **kwargs)


def _masked_fill(indices: Any, masks: list, args: tuple, kwargs: dict) -> bool:
    """``x[mask] = scalar``: one mask and a one-element value, no accumulation, which torch runs as ``masked_fill_``
    (``canDispatchToMaskedFill``; no sync on a GPU, where the scalar is a host tensor)."""
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    single = len(masks) == 1 and sum(i is not None for i in indices) == 1
    return single and not accumulate and isinstance(value, torch.Tensor) and value.numel() == 1


def _data_dependent(func: Any, args: tuple, kwargs: dict) -> bool:
    """Boolean-mask indexing (``x[mask]``, ``x[mask] = v``: a ``nonzero`` inside on a GPU) and
    ``repeat_interleave`` of a repeats tensor without ``output_size``."""
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = [i for i in indices if i is not None and i.dtype in (torch.bool, torch.uint8)]
        if func is not _aten.index.Tensor and _masked_fill(indices, masks, args, kwargs):
            return False
        return bool(masks)
    if func is _aten.repeat_interleave.Tensor or func is _aten.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None
    return False
