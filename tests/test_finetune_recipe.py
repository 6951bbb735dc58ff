"""recipes/finetune.py and the data=hf_text / data=sft groups: the default assets made locally, the token cache
built by the parent, bad input refused before any worker starts, the GPT recipe using a model folder's tokenizer,
and runs that print and save the answers before and after training (validation loss and perplexity in
metrics.json)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import transformers
from recipe_runs import ROOT, default_run_metrics, run, run_recipe
from test_recipe_configs import compose_gpt, compose_recipe
from tokenizers import Tokenizer, models, pre_tokenizers

from lightning_parallel.recipes.finetune import SAMPLES_FILE, answer, check_finetune_config
from lightning_parallel.recipes.finetune_assets import CHAT_TEMPLATE, instruction_pairs, make_default_assets
from lightning_parallel.recipes.finetune_data import decode_new, splits
from lightning_parallel.recipes.gpt import check_config
from lightning_parallel.text import load_tokenizer, open_token_cache

FINETUNE = ROOT / "recipes" / "finetune.py"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("assets") / "finetune"
    make_default_assets(folder)
    return folder


def compose_finetune(assets: Path, *overrides: str):
    return compose_recipe("finetune", f"assets={assets}", *overrides)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_default_assets_are_made_once_the_same_everywhere(tmp_path, assets):
    model, data = make_default_assets(tmp_path / "a")
    for name in ("tiny_llama/tokenizer.json", "tiny_llama/config.json", "instructions.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (assets / name).read_bytes(), name  # deterministic
    stamp = data.stat().st_mtime_ns
    assert make_default_assets(tmp_path / "a") == (model, data) and data.stat().st_mtime_ns == stamp  # reused
    tok, reason = load_tokenizer(model)
    config = transformers.AutoConfig.from_pretrained(model, local_files_only=True)
    assert tok.has_chat_template and tok.backend.chat_template == CHAT_TEMPLATE and "model folder" in reason
    assert config.vocab_size == tok.vocab_size == 512 and config.eos_token_id == tok.eos_id
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == len(instruction_pairs()) >= 200 and rows[0]["messages"][1]["role"] == "assistant"


@pytest.mark.parametrize("packing", [False, True])
def test_the_parent_builds_the_cache_and_splits_it(tmp_path, assets, packing, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_finetune(assets, f"data.packing={packing}")
    check_finetune_config(cfg)
    cache = open_token_cache(cfg.data.cache)
    assert Path(cfg.data.cache).parent == tmp_path / "data" / "token_cache" and cache.meta["kind"] == "sft"
    train, val = splits(cfg)
    n = len(train) + len(val)
    assert len(val) == max(int(n * 0.1), cfg.data.global_batch_size) and len(train) >= cfg.data.global_batch_size
    assert set(train[0]) >= {"input_ids", "labels", "position_ids" if packing else "attention_mask"}


def test_hf_text_and_a_validation_file(tmp_path, assets, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"{p} {a}" for p, a in instruction_pairs()))
    val = _jsonl(tmp_path / "val.jsonl", [{"text": f"{p} {a}"} for p, a in instruction_pairs()[:40]])
    cfg = compose_finetune(
        assets, "data=hf_text", f"data.path={docs}", f"data.val_path={val}", "data.global_batch_size=8"
    )
    check_finetune_config(cfg)
    train, val_set = splits(cfg)
    assert open_token_cache(cfg.data.val_cache).meta["kind"] == "hf_text" and len(val_set) >= 1
    assert train[0]["input_ids"].shape == (cfg.model.seq_len,)


def _no_template_tokenizer(tmp_path: Path) -> Path:
    tok = transformers.AutoTokenizer.from_pretrained(make_default_assets(tmp_path / "x")[0], local_files_only=True)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    return tmp_path / "plain"


def _big_tokenizer(tmp_path: Path) -> Path:
    word_level = Tokenizer(models.WordLevel({f"w{i}": i for i in range(600)} | {"<unk>": 600}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<unk>")
    fast.save_pretrained(tmp_path / "big")
    return tmp_path / "big"


@pytest.mark.parametrize(
    ("make", "overrides", "message"),
    [
        (
            lambda t: _jsonl(t / "d.jsonl", [{"question": "a", "reply": "b"}] * 40),
            ["data.path={file}"],
            r"data=sft needs the column\(s\) 'messages' or 'prompt'\+'completion', but the files hold \['question', "
            r"'reply'\]",
        ),
        (_no_template_tokenizer, ["data.tokenizer={file}"], r"has no chat template"),
        (_big_tokenizer, ["data.tokenizer={file}"], r"has 601 tokens but the model's vocabulary holds 512"),
        (lambda t: _jsonl(t / "e.jsonl", []), ["data.path={file}"], r"holds no rows"),
        (lambda t: t / "none.jsonl", ["data.val_path={file}"], r"data.val_path=.*names no local file"),
        (lambda t: None, ["data.global_batch_size=512"], r"fewer than one data.global_batch_size=512"),
        (lambda t: None, ["data.val_fraction=1.5"], r"data.val_fraction=1.5 must lie between 0 and 1"),
        (lambda t: None, ["model=hf_llama_tiny"], r"data=sft needs a tokenizer and there is none"),
        (lambda t: None, ["model=litgpt"], r"data=sft needs a tokenizer and there is none"),
    ],
    ids=["columns", "no-chat-template", "vocab", "empty", "val-path", "batch", "val-fraction", "bytes", "litgpt-named"],
)
def test_bad_input_is_refused_before_workers(tmp_path, assets, monkeypatch, make, overrides, message):
    monkeypatch.chdir(tmp_path)
    file = make(tmp_path)
    cfg = compose_finetune(assets, *[o.format(file=file) for o in overrides])
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        check_finetune_config(cfg)


def test_a_chat_template_file_for_a_tokenizer_without_one(tmp_path, assets, monkeypatch):
    """data.chat_template=FILE: a base folder's tokenizer without a template renders the conversations with the
    file's template: the same token ids as the assets' tokenizer that carries that template itself."""
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    plain = _no_template_tokenizer(tmp_path)
    cache = f"data.cache_dir={tmp_path / 'given'}"  # built apart from the assets' tokenizer's cache
    given = compose_finetune(assets, f"data.tokenizer={plain}", f"data.chat_template={template}", cache)
    check_finetune_config(given)
    own = compose_finetune(assets)
    check_finetune_config(own)
    assert Path(given.data.cache).parent == tmp_path / "given"
    # the cache's key holds the template: the same vocabulary and template are the same key
    assert Path(given.data.cache).name == Path(own.data.cache).name
    got, want = splits(given)[0], splits(own)[0]
    assert len(got) == len(want) >= 100
    for i in (0, 1, len(want) - 1):
        assert got[i]["input_ids"].tolist() == want[i]["input_ids"].tolist(), i
        assert got[i]["labels"].tolist() == want[i]["labels"].tolist(), i
    for bad, message in [
        ([f"data.chat_template={tmp_path / 'none.jinja'}"], r"data.chat_template=.*none.jinja' is not a file"),
        (["model=litgpt_chat_tiny", f"data.chat_template={template}"], r"needs a transformers tokenizer"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_finetune_config(compose_finetune(assets, *bad))


def test_the_gpt_recipe_uses_a_model_folders_tokenizer(tmp_path, assets, monkeypatch, caplog):
    """model=hf model.path=FOLDER: the folder's tokenizer when it has one (the text's documents tokenized), else
    the bytes; the log says which."""
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"{p} {a}" for p, a in instruction_pairs()))
    batch = ["data.global_batch_size=4"]
    with caplog.at_level(logging.INFO, logger="lightning_parallel.recipes.finetune_data"):
        cfg = compose_gpt("model=hf", f"model.path={assets / 'tiny_llama'}", f"data.path={text}", *batch)
        check_config(cfg)
        assert open_token_cache(cfg.data.cache).meta["vocab_size"] == 512
        bare = tmp_path / "bare"
        transformers.LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1).save_pretrained(bare)
        cfg = compose_gpt("model=hf", f"model.path={bare}", f"data.path={text}")
        check_config(cfg)
    assert cfg.data.cache is None
    assert "the tokenizer of the model folder" in caplog.text and "the data are UTF-8 bytes" in caplog.text
    with pytest.raises(ValueError, match=r"data=sft trains Hugging Face and LitGPT models \(model=hf\*"):
        check_config(compose_gpt("data=sft", f"data.path={text}", f"data.tokenizer={assets / 'tiny_llama'}"))


def test_answers_with_the_tokenizer_and_a_kv_cache(assets):
    """Greedy answers are text, the same twice; decoding stops at the end-of-text token."""
    tok, _ = load_tokenizer(assets / "tiny_llama")
    config = transformers.AutoConfig.from_pretrained(assets / "tiny_llama", local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    first = answer(model, tok, ["What is 3 plus 4?"], max_new_tokens=6)
    assert first == answer(model, tok, ["What is 3 plus 4?"], max_new_tokens=6) and isinstance(first[0], str)
    prompt, said = tok.encode(["Q"])[0], tok.encode([" seven."], special=False)[0]
    assert decode_new(tok, prompt + said + [tok.eos_id] + said, len(prompt)) == " seven."
    sampled = answer(model, tok, ["What is 3 plus 4?"], max_new_tokens=6, temperature=1.0, seed=1)
    assert sampled == answer(model, tok, ["What is 3 plus 4?"], max_new_tokens=6, temperature=1.0, seed=1)


def _assert_finetuned(run_dir: Path, metrics: dict, steps: int, world: int) -> None:
    assert metrics["steps"] == steps and metrics["layout"]["world_size"] == world
    assert math.isfinite(metrics["final_val_loss"])
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["final_val_loss"]))
    samples = json.loads((run_dir / SAMPLES_FILE).read_text())
    assert [s["prompt"] for s in samples] and any(s["before"] != s["after"] for s in samples), samples


def test_a_short_finetune_run(tmp_path, assets):
    """World 1, a few steps: metrics.json with the validation perplexity, samples.json beside it."""
    overrides = ["trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    got = run_recipe(FINETUNE, tmp_path, f"assets={assets}", *overrides, "sample_tokens=4", "model.lr=0.05")
    _assert_finetuned(tmp_path / "run", got, steps=4, world=1)


@pytest.mark.slow
def test_out_of_the_box(tmp_path):
    """`python recipes/finetune.py` in a fresh folder: makes its assets, trains, the answers change."""
    result = run(tmp_path, FINETUNE, timeout=600)
    metrics = default_run_metrics(tmp_path)
    (run_dir,) = (tmp_path / "outputs").glob("*/*/")
    _assert_finetuned(run_dir, metrics, steps=200, world=1)
    assert "answers before -> after training" in result.stdout
    assert metrics["final_val_loss"] < math.log(512) - 3  # far below a uniform guess over the vocabulary (6.2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["strategy=zero2", "data.packing=true"],
        ["strategy=hybrid3d", "strategy.tp=2"],  # the adapters' DTensors gathered for the answers
        ["strategy=hybrid3d", "strategy.pp=2", "peft=none", "data.packing=true"],  # every stage's layers gathered
    ],
    ids=["zero2-packed", "tp2-lora", "pp2-packed"],
)
def test_world_2(tmp_path, assets, layout):
    overrides = [*layout, "trainer.devices=2", "trainer.max_steps=20", "trainer.val_check_interval=10"]
    got = run_recipe(FINETUNE, tmp_path, f"assets={assets}", *overrides)
    _assert_finetuned(tmp_path / "run", got, steps=20, world=2)


def gpt_recipe_with_a_tokenizer(tmp_path: Path, *model: str) -> str:
    """train_gpt.py, 4 steps of ``model`` on the instruction pairs as text: it trains and samples from "The "
    with the tokenizer; returns its output."""
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"{p} {a}" for p, a in instruction_pairs()))
    overrides = ["trainer=debug", "trainer.max_steps=4", "sample_tokens=6", "data.global_batch_size=4"]
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    result = run(tmp_path, ROOT / "recipes" / "train_gpt.py", *model, f"data.path={text}", *overrides, run_dir)
    got = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert got["steps"] == 4 and math.isfinite(got["final_val_loss"]) and got["sample"].startswith("The ")
    return result.stdout + result.stderr


@pytest.mark.slow
def test_the_gpt_recipe_trains_and_samples_with_the_folders_tokenizer(tmp_path, assets):
    output = gpt_recipe_with_a_tokenizer(tmp_path, "model=hf", f"model.path={assets / 'tiny_llama'}")
    assert "Tokenizer: the tokenizer of the model folder" in output


def test_an_optimizer_the_finetune_recipe_would_ignore_is_refused(assets):
    """The fine-tune recipe trains with its model's own AdamW and has no optimizer group; one added by hand
    (+optimizer=muon) is refused by name, not silently ignored."""
    check_finetune_config(compose_finetune(assets))
    with pytest.raises(ValueError, match="the fine-tune recipe trains with the model's own AdamW"):
        check_finetune_config(compose_finetune(assets, "+optimizer=muon"))
