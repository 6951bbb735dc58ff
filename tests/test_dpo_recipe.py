"""recipes/dpo.py: bad settings and data refused in the parent before any worker (the reference that cannot be
built, with the reason), and (slow) runs as a user makes them: out of the box, held-out reward accuracy above 0.8
and the margin grown from 0; a frozen reference copy sharded by ZeRO-3 and a precomputed reference, their memory in
metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_runs import ROOT, run, run_recipe
from test_recipe_configs import compose_recipe, finetune_assets

from lightning_parallel.preference.reference import parameter_bytes
from lightning_parallel.recipes.dpo import check_dpo_config
from lightning_parallel.recipes.dpo_data import PREFERENCES_FILE, REFUSALS, make_preference_assets

DPO = ROOT / "recipes" / "dpo.py"


def compose_dpo(*overrides: str):
    return compose_recipe("dpo", *overrides)


def test_default_preference_set_is_made_once(tmp_path):
    path = make_preference_assets(tmp_path / "dpo")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 200 and path.name == PREFERENCES_FILE
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["rejected"][0]["content"] in REFUSALS
    stamp = path.stat().st_mtime_ns
    assert make_preference_assets(tmp_path / "dpo") == path and path.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["dpo.loss=hinge"], "dpo.loss='hinge' is unknown"),
        (["dpo.label_smoothing=0.2"], "used by dpo.loss=robust only"),
        (["data=sft"], "reads data=preference"),
    ],
)
def test_refused_before_launch(overrides, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_dpo(*overrides)
    with pytest.raises(ValueError, match=match):
        check_dpo_config(cfg)


def test_missing_columns_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"question": "a", "chosen": "b", "bad": "c"}) + "\n")
    cfg = compose_dpo(f"data.path={data}")
    with pytest.raises(ValueError, match=r"the files hold \['question', 'chosen', 'bad'\]: missing \['rejected'\]"):
        check_dpo_config(cfg)


def test_the_parent_builds_the_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_dpo(f"assets={tmp_path / 'dpo'}")
    check_dpo_config(cfg)
    assert Path(cfg.data.cache).is_dir() and (tmp_path / "dpo" / PREFERENCES_FILE).is_file()
    assert cfg.model.path == str(tmp_path / "dpo" / "tiny_llama")
    assert finetune_assets().is_dir()


@pytest.mark.slow
def test_out_of_the_box_learns_the_preferences(tmp_path):
    """``python recipes/dpo.py`` with nothing else, in an empty folder: held-out accuracy from 0 to above 0.8."""
    result = run(tmp_path, DPO, timeout=900)
    (metrics_file,) = (tmp_path / "outputs").glob("*/*/metrics.json")
    dpo = json.loads(metrics_file.read_text())["dpo"]
    before, after = dpo["before"], dpo["after"]
    assert before["accuracy"] == 0.0 and before["margin"] == 0.0  # policy = reference: both rewards 0 (TRL)
    assert after["accuracy"] > 0.8 and after["margin"] > 1.0, dpo
    assert dpo["reference"] == "adapters" and dpo["reference_bytes_per_rank"] == [0]
    assert "margin" in result.stdout and "answers before -> after" in result.stdout


@pytest.mark.slow
def test_reference_copy_and_precomputed_memory(tmp_path):
    """Without LoRA under ZeRO-3 the frozen copy is sharded like the policy (half of its bytes per rank of 2); a
    precomputed reference holds 8 bytes a pair."""
    steps = ["trainer.max_steps=4", "trainer.val_check_interval=4", "sample_prompts=[]"]
    zero3 = ["strategy=zero3", "trainer.devices=2", "peft=none", *steps]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    copy = run_recipe(DPO, tmp_path / "a", *zero3, f"assets={tmp_path / 'dpo'}", timeout=900)["dpo"]
    cfg = compose_dpo(f"assets={tmp_path / 'dpo'}", "peft=none")
    from lightning_parallel.recipes.finetune_generate import build_finetune_module, materialized

    whole = parameter_bytes(materialized(build_finetune_module(cfg)).model)
    assert copy["reference"] == "copy" and len(copy["reference_bytes_per_rank"]) == 2
    assert abs(sum(copy["reference_bytes_per_rank"]) - whole) <= 64 * 4 * 8, (copy, whole)  # shards' padding
    pre = run_recipe(DPO, tmp_path / "b", "dpo.precompute_reference=true", *steps, f"assets={tmp_path / 'dpo'}")
    pairs = len((tmp_path / "dpo" / PREFERENCES_FILE).read_text().splitlines())
    assert pre["dpo"]["reference"] == "precomputed" and pre["dpo"]["reference_bytes_per_rank"] == [pairs * 2 * 4]
    assert pre["dpo"]["after"]["margin"] > pre["dpo"]["before"]["margin"] == 0.0
