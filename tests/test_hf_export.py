"""`python -m lightning_parallel.checkpoint export-hf CKPT OUT_DIR`: a folder that
``AutoModelForCausalLM.from_pretrained`` loads, with the logits of the model rebuilt from the checkpoint."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency: make install installs the hf extra
from recipe_runs import GPT, run, run_recipe

from lightning_parallel.checkpoint import consolidated, main
from lightning_parallel.hf import HFCausalLM
from lightning_parallel.hf.export import export_hf, hf_config_of


def rebuilt(ckpt, config_folder=None) -> HFCausalLM:
    """The trained model as the checkpoint holds it, in this process."""
    checkpoint = consolidated(ckpt)
    module = HFCausalLM(hf_config_of(checkpoint, config_folder))
    module.materialize()  # built on meta from its config: storage first, then the checkpoint's values
    module.load_state_dict(checkpoint["state_dict"])
    return module.eval()


def assert_same_logits(ckpt, folder, config_folder=None) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = rebuilt(ckpt, config_folder)(ids), loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_pipelined_gpt2_recipe_checkpoint_exports(tmp_path):
    """GPT-2 (embedding and head tied, on different pipeline stages) trained by the recipe under pp=2, saved
    sharded; the exported folder loads with its head tied again."""
    overrides = ["model=hf_gpt2_tiny", "strategy=hybrid3d", "strategy.pp=2", "trainer.devices=2"]
    saves = ["checkpoint=periodic", "checkpoint.every_n_steps=4", f"checkpoint.dir={tmp_path / 'ckpts'}"]
    got = run_recipe(GPT, tmp_path, "trainer=debug", "trainer.max_steps=4", "sample_tokens=0", *overrides, *saves)
    ckpt = tmp_path / "ckpts" / "last.ckpt"
    assert got["steps"] == 4 and ckpt.is_dir()  # sharded: one file per rank
    out = tmp_path / "hf"
    result = run(tmp_path, "-m", "lightning_parallel.checkpoint", "export-hf", ckpt, out)
    assert f"wrote {out}" in result.stdout
    assert_same_logits(ckpt, out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def llama_checkpoint(path, with_config: bool = True):
    """A one-file checkpoint of a tiny HFCausalLM Llama (as Lightning writes it: on_save_checkpoint included)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    module = HFCausalLM(config)
    module.materialize()  # a model from a config alone is built on meta; a Trainer's setup does this
    checkpoint = {"state_dict": module.state_dict()}
    if with_config:
        module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return config


def test_a_llama_checkpoint_file_exports(tmp_path):
    llama_checkpoint(tmp_path / "llama.ckpt")
    export_hf(tmp_path / "llama.ckpt", tmp_path / "hf")
    assert_same_logits(tmp_path / "llama.ckpt", tmp_path / "hf")


def test_a_checkpoint_without_an_hf_config_needs_config(tmp_path, capsys):
    config = llama_checkpoint(tmp_path / "plain.ckpt", with_config=False)
    assert main(["export-hf", str(tmp_path / "plain.ckpt"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "holds no Hugging Face config ('hf_config')" in err and "Pass --config FOLDER" in err
    config.save_pretrained(tmp_path / "config")
    assert (
        main(["export-hf", str(tmp_path / "plain.ckpt"), str(tmp_path / "hf"), "--config", str(tmp_path / "config")])
        == 0
    )
    assert_same_logits(tmp_path / "plain.ckpt", tmp_path / "hf", tmp_path / "config")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert loaded.config.num_key_value_heads == 2


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"state_dict": {"layer.weight": torch.zeros(1)}, "hf_config": {"model_type": "llama"}},
            r"not all under 'model.",
        ),
        ({"hf_config": {"model_type": "llama"}}, r"holds no state_dict"),
    ],
    ids=["not-hf-causal-lm", "no-weights"],
)
def test_bad_checkpoints_are_refused(tmp_path, state, message):
    torch.save(state, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=message):
        export_hf(tmp_path / "bad.ckpt", tmp_path / "hf")


def test_export_refuses_a_folder_in_use(tmp_path):
    llama_checkpoint(tmp_path / "llama.ckpt")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match=r"exists and is not an empty folder"):
        export_hf(tmp_path / "llama.ckpt", tmp_path / "hf")
