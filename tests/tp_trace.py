"""Follow ``strategy.tp`` through a recipe's checks before launch: which of the package's files read it or are handed
it, and where it is derived again. Used by tests/test_tp_trace.py (the trace cannot grow unseen) and, run as a
script, prints the trace ARCHITECTURE.md lists (its section on strategy.tp):

    PYTHONPATH=$PWD python tests/tp_trace.py strategy=hybrid3d strategy.tp=2 trainer.devices=2

What counts, in the package's own files (``lightning_parallel/``, ``recipes/``):

- a **visit**: a function reads ``tp`` off one of the setting's carriers (the ``strategy`` config node, a
  ``ParallelConfig``, the frozen ``ParallelDims``) or is called with an argument named ``tp``, and every function of
  the package it was called through from the recipe's check (the path the setting took to get there). A function
  handed the carrier to check other settings (fault tolerance, precision, the experts) is not on tp's path;
- a **return**: a function hands back to a caller outside ``parallel/config.py`` and ``parallel/mesh.py`` (where the
  carriers are made) a ``ParallelConfig`` or ``ParallelDims`` equal to one handed out before but not the same object:
  the setting derived again instead of carried.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = (f"{ROOT}/lightning_parallel/", f"{ROOT}/recipes/")


CARRIER_FILES = ("lightning_parallel/parallel/config.py", "lightning_parallel/parallel/mesh.py")


@dataclass
class Trace:
    visits: list[tuple[str, str]] = field(default_factory=list)  # (file, function), in order
    returns: list[tuple[str, str]] = field(default_factory=list)

    def files(self) -> list[str]:
        """The files visited, in the order first visited."""
        return list(dict.fromkeys(file for file, _ in self.visits))


@functools.cache
def _ours(filename: str) -> str | None:
    """``filename`` relative to the repository when it is one of the package's files (asked at every call: cached)."""
    if not filename.startswith(PREFIXES):
        return None
    return str(Path(filename).relative_to(ROOT))


@contextmanager
def following_tp(trace: Trace) -> Iterator[None]:
    """Record into ``trace`` the visits and returns of ``tp`` in the package's files while inside."""
    from omegaconf import DictConfig

    from lightning_parallel.parallel.config import ParallelConfig
    from lightning_parallel.parallel.mesh import ParallelDims

    def visit(frame: Any) -> None:
        """``frame`` uses tp: it and the package's frames it was called through (the path tp took to get there)."""
        path = []
        while frame is not None and (file := _ours(frame.f_code.co_filename)) is not None:
            path.append((file, frame.f_code.co_name))
            frame = frame.f_back
        trace.visits.extend(reversed(path))

    def spy(original: Callable[..., Any], key: Callable[[tuple], Any]) -> Callable[..., Any]:
        def read(*args: Any) -> Any:
            if key(args) == "tp":
                visit(sys._getframe(1))
            return original(*args)

        return read

    patches = [
        (ParallelConfig, "__getattribute__", lambda a: a[1]),
        (ParallelDims, "__getattribute__", lambda a: a[1]),
        (DictConfig, "__getattr__", lambda a: a[1]),
        (DictConfig, "__getitem__", lambda a: a[1]),
        (DictConfig, "get", lambda a: a[1]),
    ]
    saved = [(cls, name, cls.__dict__.get(name)) for cls, name, _ in patches]
    for cls, name, key in patches:
        setattr(cls, name, spy(getattr(cls, name), key))
    crossed: list[Any] = []  # every carrier handed out of the two modules that make them

    def profile(frame: Any, event: str, arg: Any) -> None:
        file = _ours(frame.f_code.co_filename)
        if file is None:
            return
        code = frame.f_code
        if event == "call":
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            if "tp" in names and isinstance(frame.f_locals.get("tp"), int):
                visit(frame)
            return
        caller = frame.f_back and _ours(frame.f_back.f_code.co_filename)
        if event != "return" or not isinstance(arg, (ParallelConfig, ParallelDims)) or caller in CARRIER_FILES:
            return  # the settings' own modules building one are not a return of the setting
        if any(arg is c for c in crossed):
            return  # the one object, carried
        if any(arg == c for c in crossed if type(c) is type(arg)):
            trace.returns.append((file, code.co_name))  # an equal one, derived again
        crossed.append(arg)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def trace_gpt_checks(overrides: list[str]) -> Trace:
    """The trace of recipes/train_gpt.py's checks before launch (what its ``main`` runs before the workers start)."""
    from hydra import compose, initialize_config_dir

    from lightning_parallel.recipes.config import register_configs

    register_configs()
    import lightning_parallel  # noqa: F401  (the strategy names, as the script's main imports them)
    from lightning_parallel.recipes.auto import resolve_auto
    from lightning_parallel.recipes.gpt import check_config
    from lightning_parallel.simulate.prelaunch import simulate_pick

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train_gpt", overrides=overrides)
    trace = Trace()
    with following_tp(trace):
        resolve_auto(cfg, simulate_pick)
        check_config(cfg)
    return trace


if __name__ == "__main__":
    result = trace_gpt_checks(sys.argv[1:] or ["strategy=hybrid3d", "strategy.tp=2", "trainer.devices=2"])
    for file, function in dict.fromkeys(result.visits):
        print(f"visit  {file}: {function}")
    for file, function in result.returns:
        print(f"return {file}: {function}")
    print(f"{len(result.files())} files, {len(result.visits)} visits, {len(result.returns)} returns")
