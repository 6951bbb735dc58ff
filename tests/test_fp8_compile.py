"""precision=fp8 with ``compile=True`` (each layer through torch.compile, inductor on the CPU: g++ here) on the recipe
GPT: compiled in one process and under zero2 at world 2, against the eager one-process reference with the bars of
tests/test_fp8_parity.py. Inductor compiles torchao's emulated float8 layers, but by default it elides the round
trips through bf16 that eager makes between fused operations (before the float8 casts among them): elements land on
neighbouring float8 values, so compiled training is another perturbation, not the same numbers; with inductor's
``emulate_precision_casts`` the compiled layers train as eager ones (fp32's bars)."""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import LOSS_RTOL
from test_fp8_parity import CASE, PARAM_RTOL, batch, check, param_distance

EXACT = {**CASE, "name": "fp8_exact", "emulate_precision_casts": True}
LAYOUTS = {  # label -> (world, strategy, tp, cases, reference)
    "compiled": (1, "hybrid3d:compile=1", 1, [CASE], "auto"),
    "zero2-compiled": (2, "zero2:compile=1", 1, [CASE], "auto"),
}
REFERENCES = {"auto": ("auto", [CASE])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    runs = batch(tmp_path_factory, LAYOUTS, "fp8compile", REFERENCES, slow_start=300)  # inductor: minutes
    runs.runs["exact"] = (1, "hybrid3d:compile=1", [EXACT])  # inductor with emulate_precision_casts
    runs.runs["eager"] = (1, "hybrid3d", [EXACT])  # the same strategy, eager (the setting reaches no compiler)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_fp8_compiled_parity(runs, label):
    check(runs, label, LAYOUTS)
    assert runs[label].case(CASE["name"])["compiled_graphs"] > 0, f"{label}: nothing was compiled"


@pytest.mark.slow
def test_fp8_compiled_with_emulated_casts_trains_as_eager(runs):
    got, want = runs["exact"], runs["eager"]
    assert got.case("fp8_exact")["compiled_graphs"] > 0 and want.case("fp8_exact")["compiled_graphs"] == 0
    worst = max(abs(a - b) / abs(b) for a, b in zip(got.losses("fp8_exact"), want.losses("fp8_exact")))
    diff = param_distance(got.params("fp8_exact"), want.params("fp8_exact"))
    print(f"fp8 compiled with emulate_precision_casts against eager: loss rel {worst:.1e}, param rms {diff:.1e}")
    assert worst <= LOSS_RTOL and diff <= PARAM_RTOL
