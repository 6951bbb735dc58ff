"""Several GPUs (NCCL): the CPU parity matrix, each layout against one process on one GPU.

The layouts, cases and worker are the CPU tests' own (tests/test_zero_parity.py's strategies at world 2 and 4,
tests/test_hybrid3d_parity.py's ``make test`` layouts and its world-8 matrix, the 2-block GPT's ones: the 6-block
ones need a reference of their own; ``PARITY_CASES``: plain with validation, clipping, accumulation), run with
``--accelerator gpu``; a layout needing more GPUs than the machine has is skipped. Its 1F1B layouts matter most
here: their early receives are the likeliest NCCL hang.
"""

from __future__ import annotations

import json

import pytest
from conftest import PARITY_CASES, Run
from gpu_launch import Launch, needs_gpus
from test_hybrid3d_parity import LAYOUTS, WORLD8
from test_zero_parity import OFFLOAD, STRATEGIES

pytestmark = pytest.mark.gpu

LOSS_RTOL = 1e-4  # NCCL sums in another order than one process: not bitwise, as gloo often is
PARAM_ATOL = 1e-4

MATRIX = {  # label: (world, strategy spec, dp, tp)
    **{f"{s}-w{w}": (w, s, w, 1) for s in STRATEGIES for w in (2, 4)},
    **{f"{s}-w2": (2, s, 2, 1) for s in OFFLOAD},
    **{lay.id: (lay.world, lay.spec, lay.dp, lay.tp) for lay in LAYOUTS + WORLD8 if not lay.deep},
}


def _launch(tmp_path_factory, label: str, world: int, spec: str) -> Run:
    args = ["--strategy", spec, "--cases", json.dumps(PARITY_CASES)]
    out = tmp_path_factory.mktemp(label)
    return Run(Launch.start(label, "run.py", world, ["gpt", *args], out).results(timeout=600), out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    return _launch(tmp_path_factory, "reference", 1, "auto")


@pytest.mark.parametrize("label", [pytest.param(label, marks=needs_gpus(w)) for label, (w, *_) in MATRIX.items()])
def test_parity_with_one_gpu(tmp_path_factory, reference, label):
    world, spec, dp, tp = MATRIX[label]
    run = _launch(tmp_path_factory, label, world, spec)
    leaders = [d * tp for d in range(dp)]  # one rank per dp index, on the first pipeline stage
    for case in PARITY_CASES:
        name = case["name"]
        got, want = run.losses(name, leaders), reference.losses(name)
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        got_params, want_params = run.params(name), reference.params(name)
        diff = max((got_params[k].float() - want_params[k].float()).abs().max().item() for k in want_params)
        print(f"{label} {name}: max loss rel diff {worst:.1e}, max param abs diff {diff:.1e}")
        assert len(got) == len(want) and worst <= LOSS_RTOL, f"{label} {name}: {got} vs one GPU {want}"
        assert got_params.keys() == want_params.keys() and diff <= PARAM_ATOL, f"{label} {name}: params {diff:.1e}"
