"""Checkpoints of HFCausalLM(peft_config=LoraConfig(...)): a save holds the adapters and their optimizer states and
names the frozen base (folder and sha256) instead of copying it; a ZeRO-3 save's adapters are whole, so are a pp=2
save's over its stages; it resumes at other layouts with the next losses of an uninterrupted run; another base is
refused; export-peft writes a folder peft loads and export-hf --merge one transformers loads, each with the trained
model's logits.

The uninterrupted run is zero3 at world 2 (its parity with one process: tests/test_hf_lora.py); it saves after
``SAVE`` steps. Epochs of one step: Lightning resumes a checkpoint with one batch of the epoch it was saved in and then
starts the next epoch, which is then the uninterrupted order (tests/workers/cases/hf.py's ``SaveAt``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import peft
import pytest
import torch
import transformers
from causal_lm_parity import GLOBAL_BATCH, LR, SEQ_LEN
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from test_hf_lora import LORA, MODELS, lora_config

from lightning_parallel import _compat
from lightning_parallel.checkpoint import consolidated, main
from lightning_parallel.hf import HFCausalLM
from lightning_parallel.hf.adapters import PEFT_KEY, folder_sha256, without_values
from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.strategies import sharded_checkpoint

SAVE, STEPS = 5, 10
MODEL = "llama"

# label -> (world, strategy, model, tp, resumes from, saves at step); savers come before the runs resuming from them
FAST = {
    "uninterrupted zero3": (2, "zero3", MODEL, 1, None, SAVE),
    "resumed tp2": (2, "hybrid3d:tp=2", MODEL, 2, "uninterrupted zero3", STEPS),
}
SLOW = {
    "uninterrupted zero3": (2, "zero3", MODEL, 1, None, SAVE),
    "uninterrupted zero3 full format": (2, "zero3:checkpoint_format=full", MODEL, 1, None, SAVE),
    "full fine-tuning zero3": (2, "zero3", MODEL, 1, None, SAVE),
    "resumed zero1": (2, "zero1", MODEL, 1, "uninterrupted zero3", None),
    "resumed tp2 from one file": (2, "hybrid3d:tp=2", MODEL, 2, "uninterrupted zero3 full format", None),
    "resumed tp2": (2, "hybrid3d:tp=2", MODEL, 2, "uninterrupted zero3", 7),
    "resumed zero3 from tp2": (2, "zero3", MODEL, 1, "resumed tp2", STEPS),
    "resumed by Lightning's own strategy": (1, "auto", MODEL, 1, "uninterrupted zero3 full format", None),
    "uninterrupted pp2": (2, "hybrid3d:pp=2", MODEL, 1, None, SAVE),
    "resumed zero2 from pp2": (2, "zero2", MODEL, 1, "uninterrupted pp2", None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """The base (as test_hf_lora.py writes it) and another one with other weights."""
    out = {}
    for name, seed in (("base", 0), ("other", 1)):
        torch.manual_seed(seed)
        folder = tmp_path_factory.mktemp(f"lora_ckpt_{name}")
        transformers.AutoModelForCausalLM.from_config(MODELS[MODEL]()).save_pretrained(folder)
        out[name] = str(folder)
    return out


def launch_runs(tmp_path_factory, folders, runs: dict, tag: str) -> tuple[Batch, dict[str, str]]:
    """One launch of cases/hf.py; returns the batch and each saving run's checkpoint path."""
    ckpt_dir = tmp_path_factory.mktemp(f"lora_ckpts{tag}")
    path = {label: str(ckpt_dir / f"{label.replace(' ', '_')}.ckpt") for label, run in runs.items() if run[5]}
    spec = {}
    for label, (world, strategy, model, _, source, save_step) in runs.items():
        case = {"name": "train", "path": folders["base"], "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "lr": LR,
                "steps": STEPS, "epoch_steps": 1, "save": path.get(label), "save_step": save_step,
                "resume": path[source] if source else None}  # fmt: skip
        if "full fine-tuning" not in label:
            case["lora"] = LORA[model]
        spec[label] = (world, strategy, [case])
    batch = Batch(tmp_path_factory, spec, tag=f"lora_ckpt{tag}", worker="hf")
    batch[next(iter(runs))]  # launched now: the checkpoints are written
    return batch, path


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders):
    return launch_runs(tmp_path_factory, folders, FAST, "")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders):
    return launch_runs(tmp_path_factory, folders, SLOW, "_slow")


def check_resumed(batch: Batch, runs: dict, label: str, folders) -> None:
    """Losses after the resume as the uninterrupted run's, and the same parameters at the end (the base as the
    folder holds it)."""
    world, _, _, tp, source, _ = runs[label]
    leaders = list(range(0, world, tp))
    whole = batch["uninterrupted zero3"].losses("train")
    assert len(whole) == STEPS
    assert_same_losses(batch[label].losses("train", leaders), whole[runs[source][5] :], f"{label}: losses")
    params = batch[label].params("train")
    assert_same_params(params, batch["uninterrupted zero3"].params("train"), f"{label}: final parameters")
    base = HFCausalLM(folders["base"], peft_config=lora_config(MODEL)).state_dict()
    changed = [k for k, v in base.items() if "lora_" not in k and not torch.equal(params[k], v)]
    assert not changed, f"{label}: frozen base changed: {changed[:4]}"


def check_saved_adapters(ckpt: str, folders, trained: dict[str, torch.Tensor] | None = None) -> None:
    """The save holds exactly the adapters, whole (global shapes, trained: B factors start at zero; the run's
    gathered values when saved at its end), each with its AdamW moments, and the base's path and hash with peft's
    config; no frozen tensor."""
    module = HFCausalLM(folders["base"], peft_config=lora_config(MODEL))
    adapters = {n: p for n, p in module.named_parameters() if p.requires_grad}
    checkpoint = consolidated(ckpt)
    state = checkpoint["state_dict"]
    assert set(state) == set(adapters), f"saved model tensors {sorted(set(state) ^ set(adapters))[:4]}"
    for name, tensor in state.items():
        assert tensor.shape == adapters[name].shape and tensor.abs().sum() > 0, f"{name}: empty or untrained"
        if trained is not None:
            assert torch.equal(tensor, trained[name]), f"{name}: saved values are not the run's"
    moments = checkpoint["optimizer_states"][0]["state"]
    assert len(moments) == len(adapters)
    assert all(s["exp_avg"].shape == s["exp_avg_sq"].shape and s["exp_avg"].abs().sum() > 0 for s in moments.values())
    want = {"path": str(Path(folders["base"]).resolve()), "sha256": folder_sha256(folders["base"])}
    assert checkpoint[PEFT_KEY]["base"] == {**want, "over": "safetensors files"}
    config = peft.PeftConfig.from_peft_type(**json.loads(checkpoint[PEFT_KEY]["config"]))
    assert dataclasses.replace(config, base_model_name_or_path=None) == lora_config(MODEL)  # peft's own config


def trained_module(folder: str, params: dict[str, torch.Tensor], model: str = MODEL) -> HFCausalLM:
    """A one-process HFCausalLM with a run's final (gathered) state."""
    module = HFCausalLM(folder, peft_config=lora_config(model))
    module.load_state_dict(params)
    return module.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    return out if torch.is_tensor(out) else out.logits


def check_exports(ckpt: str, params: dict[str, torch.Tensor], folders, out: Path, model: str = MODEL) -> None:
    """export-peft loaded by peft onto the base, and export-hf --merge loaded by transformers, each with the logits
    of the run's trained model in one process."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    want = logits(trained_module(folders["base"], params, model), ids)
    assert main(["export-peft", ckpt, str(out / "peft")]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "peft").iterdir()}
    base = transformers.AutoModelForCausalLM.from_pretrained(folders["base"], local_files_only=True)
    loaded = peft.PeftModel.from_pretrained(base, out / "peft").eval()
    torch.testing.assert_close(logits(loaded, ids), want, atol=1e-5, rtol=0)
    assert main(["export-hf", ckpt, str(out / "merged"), "--merge"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", local_files_only=True).eval()
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(logits(merged, ids), want, atol=1e-5, rtol=0)


# ----- fast tier: one world-2 launch (zero3 saving at step 5, resumed at tp=2 saving at its end) -----


def test_zero3_save_holds_whole_adapters_and_names_the_base(fast_runs, folders):
    check_saved_adapters(fast_runs[1]["uninterrupted zero3"], folders)


def test_zero3_save_resumes_at_tp2_with_the_uninterrupted_losses(fast_runs, folders):
    check_resumed(fast_runs[0], FAST, "resumed tp2", folders)


def test_tp2_save_exports_for_peft_and_merged_with_the_trained_logits(fast_runs, folders, tmp_path, capsys):
    batch, saves = fast_runs
    ckpt, params = saves["resumed tp2"], batch["resumed tp2"].params("train")
    check_saved_adapters(ckpt, folders, params)
    check_exports(ckpt, params, folders, tmp_path)
    assert main(["export-hf", ckpt, str(tmp_path / "not_merged")]) == 2
    assert "holds LoRA adapters, not the whole model: pass --merge" in capsys.readouterr().err


class _OneProcess:
    """What sharded_checkpoint.load asks of a strategy, for one process without a process group."""

    def __init__(self, module: HFCausalLM) -> None:
        self.model = self.lightning_module = module
        self.global_rank, self.world_size, self.optimizers = 0, 1, []

    def broadcast(self, obj):
        return obj


def test_sharded_load_reads_the_adapters_and_refuses_another_base(fast_runs, folders):
    batch, saves = fast_runs
    ckpt = saves["resumed tp2"]
    module = HFCausalLM(folders["base"], peft_config=lora_config(MODEL))
    sharded_checkpoint.load(_OneProcess(module), ckpt, [None])  # no base tensor expected or read
    assert_same_params(module.state_dict(), batch["resumed tp2"].params("train"), "loaded in place")
    other = HFCausalLM(folders["other"], peft_config=lora_config(MODEL))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    saved, here = (Path(folders[name]).resolve() for name in ("base", "other"))
    match = (
        rf"trained on the base {re.escape(str(saved))} \(sha256 {folder_sha256(saved)[:16]}.*this HFCausalLM's base "
        rf"is {re.escape(str(here))} \(sha256 {folder_sha256(here)[:16]}.*Build HFCausalLM from {re.escape(str(saved))}"
    )
    with pytest.raises(ValueError, match=match):
        sharded_checkpoint.load(_OneProcess(other), ckpt, [None])
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items()), "a refused load changed the model"
    with pytest.raises(ValueError, match=match):  # a one-file checkpoint: Lightning's on_load_checkpoint hook
        other.on_load_checkpoint(consolidated(ckpt))


# ----- slow tier -----


@pytest.mark.slow
@pytest.mark.parametrize(
    "label",
    ["resumed zero1", "resumed tp2 from one file", "resumed tp2", "resumed zero3 from tp2",
     "resumed by Lightning's own strategy", "resumed zero2 from pp2"],
)  # fmt: skip
def test_lora_checkpoint_resumes_at_other_layouts(label, slow_runs, folders):
    check_resumed(slow_runs[0], SLOW, label, folders)


@pytest.mark.slow
def test_zero3_end_save_holds_the_runs_gathered_adapters_and_exports(slow_runs, folders, tmp_path):
    batch, saves = slow_runs
    ckpt, params = saves["resumed zero3 from tp2"], batch["resumed zero3 from tp2"].params("train")
    check_saved_adapters(ckpt, folders, params)
    check_exports(ckpt, params, folders, tmp_path)


@pytest.mark.slow
def test_pp2_save_holds_every_stages_adapters_whole(slow_runs, folders):
    """Saved mid-run under pp=2: each stage's adapters and their moments, together the whole set; the run itself is
    the uninterrupted zero3 run (losses and final parameters)."""
    batch, saves = slow_runs
    check_saved_adapters(saves["uninterrupted pp2"], folders)
    whole = batch["uninterrupted zero3"].losses("train")
    assert_same_losses(batch["uninterrupted pp2"].losses("train", [0]), whole, "uninterrupted pp2: losses")
    final = batch["uninterrupted zero3"].params("train")
    assert_same_params(batch["uninterrupted pp2"].params("train"), final, "uninterrupted pp2: final parameters")


@pytest.mark.slow
def test_one_file_save_holds_the_adapters_only(slow_runs, folders):
    path = slow_runs[1]["uninterrupted zero3 full format"]
    assert Path(path).is_file()
    check_saved_adapters(path, folders)


def disk_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def tensor_bytes(path: str) -> int:
    return sum(math.prod(md.size) * md.properties.dtype.itemsize for md in checkpoint_io.saved_tensors(path).values())


@pytest.mark.slow
def test_adapter_checkpoint_is_smaller_than_a_full_one(slow_runs, folders):
    """Bytes on disk of the zero3 LoRA save (a sharded folder) against full fine-tuning's at the same layout and
    step (the README's ratio), and the bytes of the tensors they hold: the adapters and their two AdamW moments."""
    saves = slow_runs[1]
    lora, full = saves["uninterrupted zero3"], saves["full fine-tuning zero3"]
    on_disk, tensors = disk_bytes(lora) / disk_bytes(full), tensor_bytes(lora) / tensor_bytes(full)
    print(f"LoRA checkpoint {disk_bytes(lora)} bytes on disk, full fine-tuning {disk_bytes(full)}: {on_disk:.3f}; "
          f"tensors {tensor_bytes(lora)} and {tensor_bytes(full)} bytes: {tensors:.3f}")  # fmt: skip
    module = HFCausalLM(folders["base"], peft_config=lora_config(MODEL))
    adapters = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    steps_and_order = sum(1 for p in module.parameters() if p.requires_grad) * (4 + 2 * 8)  # fp32 step, int64 pair
    assert tensor_bytes(lora) == 3 * adapters + steps_and_order
    assert on_disk < 0.85 and tensors < 0.2


# ----- no process group -----


def test_a_base_given_as_an_object_is_named_by_its_tensors(folders, tmp_path, capsys):
    """No folder: the save names the base by a hash over its tensors; the same weights pass, others are refused;
    --merge needs --base, and takes a folder with those weights."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["base"], local_files_only=True)
    module = HFCausalLM(hf, peft_config=lora_config(MODEL))
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert set(checkpoint["state_dict"]) == {n for n, p in module.named_parameters() if p.requires_grad}
    assert checkpoint[PEFT_KEY]["base"]["path"] is None and checkpoint[PEFT_KEY]["base"]["over"] == "tensors"
    same = transformers.AutoModelForCausalLM.from_pretrained(folders["base"], local_files_only=True)
    HFCausalLM(same, peft_config=lora_config(MODEL)).check_checkpoint(checkpoint)
    other = transformers.AutoModelForCausalLM.from_pretrained(folders["other"], local_files_only=True)
    with pytest.raises(ValueError, match=r"trained on the base a model given as an object \(no folder\) \(sha256"):
        HFCausalLM(other, peft_config=lora_config(MODEL)).check_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "one.ckpt")
    assert main(["export-hf", str(tmp_path / "one.ckpt"), str(tmp_path / "a"), "--merge"]) == 2
    assert "which was given as an object (no folder): pass --base FOLDER" in capsys.readouterr().err
    assert (
        main(["export-hf", str(tmp_path / "one.ckpt"), str(tmp_path / "b"), "--merge", "--base", folders["base"]]) == 0
    )
    assert (
        main(["export-hf", str(tmp_path / "one.ckpt"), str(tmp_path / "c"), "--merge", "--base", folders["other"]]) == 2
    )
    assert "adapters fit only the base they were trained on" in capsys.readouterr().err


def test_a_base_without_values_is_not_hashed_and_its_adapters_are_not_saved():
    """The rule for a base without values (meta, or the simulator's fake tensors): built without a hash; every save
    and every resume (both ask for the record) refused, naming the tensor and the fix. With values: hashed at build."""
    with torch.device("meta"):
        module = HFCausalLM(MODELS[MODEL](), peft_config=lora_config(MODEL))
    assert module._base_identity.valueless and module._base_identity._sha256 is None
    checkpoint = {"state_dict": {}}
    with pytest.raises(ValueError, match=r"built without values \(model\..* is on the meta device or fake\)"):
        module.on_save_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="build HFCausalLM from a save_pretrained folder"):
        module.check_checkpoint({PEFT_KEY: {"base": {"sha256": "0" * 64, "over": "tensors", "path": None}}})
    with _compat.fake_tensor_mode():
        assert without_values(torch.nn.Linear(2, 2)) == ["weight", "bias"]
    real = HFCausalLM(MODELS[MODEL](), peft_config=lora_config(MODEL))  # from a config, on the host: hashed now
    assert not real._base_identity.valueless and len(real._base_identity.record()["sha256"]) == 64


@pytest.mark.slow
def test_gpt2_adapters_export_with_fan_in_fan_out(tmp_path):
    """GPT-2's Conv1D layers (peft's fan_in_fan_out): a one-file save of trained adapters exports for peft and merged,
    each with the module's logits."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(MODELS["gpt2"]()).save_pretrained(tmp_path / "base")
    module = HFCausalLM(str(tmp_path / "base"), peft_config=lora_config("gpt2"))
    with torch.no_grad():  # trained adapters: B is nonzero
        for p in (p for p in module.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "gpt2.ckpt")
    check_exports(str(tmp_path / "gpt2.ckpt"), module.state_dict(), {"base": str(tmp_path / "base")}, tmp_path,
                  model="gpt2")  # fmt: skip
