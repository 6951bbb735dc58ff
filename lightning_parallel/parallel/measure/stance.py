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


class EagerStance:
    """A context manager: ``torch.compile``d functions run eagerly inside it, and compile as usual after."""

    def __init__(self) -> None:
        self._stance: Any = None

    def __enter__(self) -> EagerStance:
        self._stance = torch.compiler.set_stance("force_eager")  # set now; its __exit__ restores the prior stance
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stance is not None:
            self._stance.__exit__(*exc)
            self._stance = None
