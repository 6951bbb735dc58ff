"""Where the mesh strategies build a model and where they put it: Lightning glue over ``parallel/materialize.py``.

Under a layout that keeps a part of the model on each rank (pp, tp or ZeRO-3; ``splits_model``), no rank holds a
whole copy of the model that it did not build itself:

- **built outside any context** (``model = MyModule(); trainer.fit(model)``, the usual case): the host holds the
  whole model, as the user built it, and it stays there. The strategy does not move it to the device whole:
  :func:`~lightning_parallel.parallel.parallelize.parallelize` splits it (on the meta device under tp or ZeRO-3,
  the host values set aside) and each rank copies only its slices to its device; the host copy is then dropped.
- **built in** ``configure_model`` **or under** ``Trainer.init_module()``: on the meta device, so it is never
  whole anywhere, on the host or on a device; once split, each rank materializes its pieces and initializes them
  with the module's ``reset_parameters()`` (``protocol.reset_units``), the values a single process gets when it
  builds the module on the host with the same seed. The CPU generator's state is noted when building starts, so
  draws from the global generator replay from there (``empty_init`` changes nothing: values are always set).
- Otherwise (ZeRO 0-2 alone, with cp, ep or spatial beside it) every rank holds all the parameters by design:
  Lightning's own placement, the model moved to (or built on) the device whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

from typing_extensions import override

from lightning_parallel.parallel.materialize import splits_model


class ModelPlacement:
    """Lightning's build and placement hooks of both front doors, over ``runtime``
    (:class:`~lightning_parallel.strategies.runtime.MeshRuntime`: the settings, the meta build and its RNG state)."""

    runtime: Any  # MeshRuntime
    calls_materialize = True  # protocol.strategy_calls_materialize: each rank's pieces filled through materialize()

    def _built_on_meta(self) -> contextlib.AbstractContextManager:
        return self.runtime.built_on_meta()

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module()``: on the meta device under a layout that splits the model (see the module
        docstring), else Lightning's (on the device)."""
        if not splits_model(self.runtime.config):
            with super().tensor_init_context(empty_init):  # type: ignore[misc]
                yield
            return
        with self._built_on_meta(), self.precision_plugin.tensor_init_context():  # type: ignore[attr-defined]
            yield

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model``: on the meta device under a layout that splits the model; each rank materializes
        only its pieces once it is split."""
        if not splits_model(self.runtime.config):
            yield
            return
        with self._built_on_meta():
            yield

    @override
    def model_to_device(self) -> None:
        """Whole onto the device only when every rank holds all of it (else :meth:`place_split_model`, once split)."""
        model = self.model  # type: ignore[attr-defined]
        assert model is not None
        if splits_model(self.runtime.config) or any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return  # parallelize() puts each rank's pieces on its device (a meta build: its materialize(device))
        model.to(self.root_device)  # type: ignore[attr-defined]

    def place_split_model(self) -> None:
        """After the split, everything is on this rank's device already (ZeRO-3 offload: parameter shards on the
        host); ``.to`` sets what Lightning reports as the module's device and moves torchmetrics' states. Under
        offload on an accelerator FSDP2 brings the shards back to pinned host memory at once."""
        if splits_model(self.runtime.config):
            self.model.to(self.root_device)  # type: ignore[attr-defined]
