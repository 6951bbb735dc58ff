"""Assertions that a parallel run is the same training as the single-process reference."""

from __future__ import annotations

import torch

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def assert_same_losses(got: list[float], want: list[float], label: str, rtol: float = LOSS_RTOL) -> float:
    """Returns the largest relative loss difference (at most ``rtol``)."""
    assert len(got) == len(want), f"{label}: {len(got)} losses, reference has {len(want)}"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        rel = abs(g - w) / abs(w)
        assert rel <= rtol, f"{label}: step {i} loss {g:.8f} != reference {w:.8f} (rel {rel:.1e})"
        worst = max(worst, rel)
    return worst


def assert_same_params(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str, atol: float = PARAM_ATOL
) -> float:
    """Returns the largest absolute parameter difference (at most ``atol``)."""
    assert got.keys() == want.keys(), f"{label}: parameter names differ: {set(got) ^ set(want)}"
    worst = 0.0
    for name in want:
        diff = (got[name].float() - want[name].float()).abs().max().item()
        assert diff <= atol, f"{label}: {name} differs by {diff:.2e} after training"
        worst = max(worst, diff)
    return worst
