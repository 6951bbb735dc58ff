"""precision=fp8 checkpoints hold the high-precision weights: a ZeRO-3 run with float8 all-gather (world 2) saves a
sharded folder of fp32 tensors under the plain model's names, which resumes into a bf16-mixed run at tp=2 and an fp8
run under ZeRO-2, each against the same checkpoint consolidated and resumed in one process (the plain Trainer, the
same precision). Two steps after resuming: the first checks the weights, the second the optimizer state."""

from __future__ import annotations

import pytest
import torch
from conftest import Batch
from parity import assert_same_losses

from lightning_parallel.checkpoint import consolidate
from lightning_parallel.parallel.checkpoint import files as checkpoint_io

EPOCH, RESUMED = 5, 2
FP8_AG = {"precision": "fp8", "fp8": {"fsdp_float8_all_gather": True}}
# resumed against one process from the same weights, 2 steps: bf16 autocast sums split over tp (the project's bf16
# bar, tests/test_zero_parity.py), fp8 dynamic scales per dp rank (tests/test_fp8_parity.py: the batch-split noise
# after 10 steps, 1.2e-4, x 4)
BARS = {"bf16-mixed": 1e-3, "fp8": 5e-4}


@pytest.mark.slow
def test_fp8_checkpoint_resumes_in_bf16_and_fp8_at_other_layouts(tmp_path, tmp_path_factory):
    ckpt = tmp_path / "fp8_zero3.ckpt"
    base = {"epoch_steps": EPOCH}
    save = {**base, **FP8_AG, "name": "save", "steps": EPOCH, "save": str(ckpt)}
    saved = Batch(tmp_path_factory, {"zero3": (2, "zero3", [save])})
    assert len(saved["zero3"].losses("save")) == EPOCH
    tensors = checkpoint_io.saved_tensors(ckpt)
    weights = {k: md for k, md in tensors.items() if k.startswith("state_dict.")}
    assert weights["state_dict.model.blocks.0.mlp.fc.weight"].properties.dtype == torch.float32
    assert all(md.properties.dtype == torch.float32 for md in weights.values()), weights
    assert set(weights) == {f"state_dict.{k}" for k in saved["zero3"].params("save")}  # the plain model's names
    one_file = consolidate(ckpt, tmp_path / "fp8_zero3.pt")
    state = torch.load(one_file, weights_only=True)["state_dict"]  # ordinary tensors: loads with weights_only
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())

    def resume(precision: dict, path) -> list[dict]:
        return [{**base, **precision, "name": "resume", "steps": EPOCH + RESUMED, "resume": str(path)}]

    bf16, fp8 = {"precision": "bf16-mixed"}, {"precision": "fp8"}
    runs = {
        "bf16-tp2": (2, "hybrid3d:tp=2", resume(bf16, ckpt)),
        "fp8-zero2": (2, "zero2", resume(fp8, ckpt)),
        "bf16-one": (1, "auto", resume(bf16, one_file)),
        "fp8-one": (1, "auto", resume(fp8, one_file)),
    }
    resumed = Batch(tmp_path_factory, runs, tag="fp8resume")
    for label, leaders, precision in (("bf16-tp2", [0], "bf16-mixed"), ("fp8-zero2", None, "fp8")):
        want = resumed[label.split("-")[0] + "-one"].losses("resume")
        assert len(want) == RESUMED
        got = resumed[label].losses("resume", leaders)
        rel = assert_same_losses(got, want, f"fp8 checkpoint resumed as {label}", BARS[precision])
        print(f"fp8 zero3 checkpoint resumed as {label}: loss rel {rel:.1e} (bar {BARS[precision]})")


@pytest.mark.slow
def test_an_fp8_hf_llama_recipe_checkpoint_exports_ordinary_tensors(tmp_path):
    """The recipe trains the tiny HF Llama in fp8 under ZeRO-3 with float8 all-gather and saves sharded; export-hf
    writes a folder of fp32 tensors that transformers loads, with the logits of the checkpoint's model rebuilt in fp32
    (no float8 anywhere)."""
    from recipe_runs import GPT, run, run_recipe
    from safetensors.torch import load_file
    from test_hf_export import assert_same_logits

    overrides = ["model=hf_llama_tiny", "strategy=zero3", "trainer.devices=2", "precision=fp8"]
    overrides += ["precision.fsdp_float8_all_gather=true", "checkpoint=periodic", "checkpoint.every_n_steps=4"]
    got = run_recipe(GPT, tmp_path, "trainer=debug", "trainer.max_steps=4", "sample_tokens=0", *overrides,
                     f"checkpoint.dir={tmp_path / 'ckpts'}", timeout=600)  # fmt: skip
    ckpt = tmp_path / "ckpts" / "last.ckpt"
    assert got["steps"] == 4 and got["layout"]["precision"] == "fp8" and ckpt.is_dir()
    out = tmp_path / "hf"
    assert f"wrote {out}" in run(tmp_path, "-m", "lightning_parallel.checkpoint", "export-hf", ckpt, out).stdout
    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values()), {t.dtype for t in tensors.values()}
    assert_same_logits(ckpt, out)
