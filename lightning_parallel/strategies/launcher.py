"""Lightning's subprocess launcher, after the strategy has checked the model in the launching process (a model
the layout cannot split would otherwise re-run the whole script on every rank before failing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.core.module import LightningModule
from typing_extensions import override

from lightning_parallel._compat import SubprocessScriptLauncher


class CheckFirstLauncher(SubprocessScriptLauncher):
    def __init__(self, strategy: Any, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        model = args[0] if args else None  # fit, validate, test and predict take the model first
        if isinstance(model, LightningModule):
            self._strategy.check_model(model)
        return super().launch(function, *args, trainer=trainer, **kwargs)
