"""Measuring a compiled model: the dispatch-mode counters run it eagerly. Pure torch.

``torch.compile`` does not trace under a user ``TorchDispatchMode`` (the byte, FLOP and activation counters of
this package are such modes), and a function whose first call meets one is marked as skipped for good: it is
never compiled afterwards (seen with torch 2.13: a recipe run with ``compile=True`` whose first batch was
measured stayed eager for the whole fit). Every counter's window therefore runs under torch's ``force_eager``
stance, which leaves no such mark: the compiled layers compile on their first call outside the window, and the
window counts the eager operators (the same collectives, FLOPs and saved activations, which a compiled graph
would partly hide from a dispatch mode).
"""

from __future__ import annotations

from typing import Any

import torch

_open = 0  # EagerStance windows open now: they may close in any order (callbacks' hooks do not nest)
_prior: Any = None  # torch's stance object of the first window: its __exit__ restores the stance before it


class EagerStance:
    """A context manager: ``torch.compile``d functions run eagerly inside it, and compile as usual after.

    Windows may overlap and close in any order; the stance returns to what it was when the last one closes.
    """

    def __init__(self) -> None:
        self._active = False

    def __enter__(self) -> EagerStance:
        global _open, _prior
        if not self._active:
            if _open == 0:
                _prior = torch.compiler.set_stance("force_eager")  # set now; remembers the stance it replaced
            _open += 1
            self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        global _open, _prior
        if not self._active:
            return
        self._active = False
        _open -= 1
        if _open == 0:
            _prior.__exit__(None, None, None)
            _prior = None
