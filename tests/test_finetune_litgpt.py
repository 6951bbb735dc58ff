"""LitGPT in recipes/finetune.py and the GPT recipe's tokenized data: the tiny LitGPT checkpoint folder made
locally, LitGPT's tokenizer and prompt style writing the samples (prompt / completion rows, single-turn
conversations), what LitGPT cannot take refused before any worker starts, answers from LitGPT's own generation with
its KV cache, and a short run that trains, builds the cache and saves the answers before and after.
(The world-2 parity of LitGPT on padded sft batches: tests/test_sft_parity.py's "litgpt" runs.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from litgpt import GPT, Config  # a test dependency: make install installs litgpt
from litgpt.prompts import save_prompt_style
from recipe_runs import ROOT, run_recipe
from test_finetune_recipe import (
    _assert_finetuned,
    _big_tokenizer,
    _jsonl,
    compose_finetune,
    gpt_recipe_with_a_tokenizer,
)
from test_recipe_configs import compose_gpt

from lightning_parallel.causal_lm import IGNORE_INDEX
from lightning_parallel.recipes.finetune import answer, check_finetune_config
from lightning_parallel.recipes.finetune_assets import LITGPT_DIR, SPECIALS, instruction_pairs, make_default_assets
from lightning_parallel.recipes.finetune_data import splits, tokenizer_of
from lightning_parallel.recipes.gpt import check_config
from lightning_parallel.text import load_tokenizer, open_token_cache

FINETUNE = ROOT / "recipes" / "finetune.py"
FOLDER_FILES = ("model_config.yaml", "lit_model.pth", "tokenizer.json", "tokenizer_config.json", "prompt_style.yaml")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_default_assets(tmp_path_factory.mktemp("assets") / "finetune")[0].parent


def compose_litgpt(assets: Path, *overrides: str):
    return compose_finetune(assets, "model=litgpt_chat_tiny", *overrides)


def _gpt(folder: Path) -> GPT:
    model = GPT(Config.from_file(folder / "model_config.yaml"))
    model.load_state_dict(torch.load(folder / "lit_model.pth", weights_only=True))
    return model


def test_the_litgpt_asset(tmp_path, assets):
    """A litgpt checkpoint folder written with litgpt's own pieces, the same bytes on every machine; LitGPT's
    tokenizer and the folder's prompt style read from it."""
    folder = assets / LITGPT_DIR
    make_default_assets(tmp_path / "a")
    for name in FOLDER_FILES:
        assert (tmp_path / "a" / LITGPT_DIR / name).read_bytes() == (folder / name).read_bytes(), name
    tok, reason = load_tokenizer(folder)
    assert tok.is_litgpt and "LitGPT's tokenizer of the checkpoint folder" in reason
    assert type(tok.prompt_style).__name__ == "Phi2" and tok.render_prompt("Hi?") == "Instruct: Hi?\nOutput:"
    assert Config.from_file(folder / "model_config.yaml").padded_vocab_size == tok.vocab_size == 512
    assert tok.eos_id == SPECIALS.index("<|end|>") and not tok.has_chat_template
    _gpt(folder)  # the weights load into the config's GPT, strictly
    save_prompt_style("alpaca", tmp_path / "a" / LITGPT_DIR)  # the prompt style writes the samples: a new cache key
    restyled = load_tokenizer(tmp_path / "a" / LITGPT_DIR)[0]
    assert type(restyled.prompt_style).__name__ == "Alpaca" and restyled.fingerprint() != tok.fingerprint()


def _first_sample(cfg) -> tuple[list[int], list[int]]:
    row = splits(cfg)[0][0]
    assert set(row) == {"input_ids", "labels"}  # padded, and no attention mask: LitGPT's GPT takes none
    return row["input_ids"].tolist(), row["labels"].tolist()


def test_samples_in_litgpt_s_prompt_style(tmp_path, assets, monkeypatch):
    """A single-turn conversation and the same pair as prompt / completion columns give the same sample: the
    prompt in the prompt style, the answer and EOS after it, the loss on the answer and EOS only."""
    monkeypatch.chdir(tmp_path)
    cfg = compose_litgpt(assets)
    check_finetune_config(cfg)
    tok, ids, labels = tokenizer_of(cfg), *_first_sample(cfg)
    prompt, completion = instruction_pairs()[0]
    want_prompt = tok.encode([tok.render_prompt(prompt)])[0]
    want = want_prompt + tok.encode([completion], special=False)[0] + [tok.eos_id]
    assert ids[: len(want)] == want and set(ids[len(want) :]) == {tok.pad_id}
    assert labels[: len(want_prompt)] == [IGNORE_INDEX] * len(want_prompt) and set(labels[len(want) :]) == {-100}
    assert labels[len(want_prompt) : len(want)] == want[len(want_prompt) :]
    rows = [{"prompt": p, "completion": c} for p, c in instruction_pairs()]
    pairs = compose_litgpt(assets, f"data.path={_jsonl(tmp_path / 'pairs.jsonl', rows)}")
    check_finetune_config(pairs)
    assert pairs.data.cache != cfg.data.cache and _first_sample(pairs) == (ids, labels)


def _turns(tmp_path: Path) -> Path:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"}]
    return _jsonl(tmp_path / "t.jsonl", [{"messages": [*chat, {"role": "assistant", "content": "b"}]}] * 40)


@pytest.mark.parametrize(
    ("make", "overrides", "message"),
    [
        (lambda t: None, ["data.packing=true"], r"data.packing=true with model=litgpt\*: LitGPT's GPT takes no "
         r"position_ids and no block mask, .* set data.packing=false"),
        (_turns, ["data.path={file}"], r"has the turns \['system', 'user', 'assistant'\], and LitGPT's prompt "
         r"styles write one user prompt"),
        (_big_tokenizer, ["data.tokenizer={file}"], r"has 601 tokens but the model's vocabulary holds 512"),
        (lambda t: None, ["model=gpt_tiny"], r"recipes/finetune.py trains Hugging Face and LitGPT models"),
    ],
    ids=["packing", "turns", "vocab", "gpt"],
)  # fmt: skip
def test_what_litgpt_cannot_take_is_refused_before_workers(tmp_path, assets, monkeypatch, make, overrides, message):
    monkeypatch.chdir(tmp_path)
    file = make(tmp_path)
    with pytest.raises(ValueError, match=message):
        check_finetune_config(compose_litgpt(assets, *[o.format(file=file) for o in overrides]))


def _folder_model(assets: Path) -> list[str]:
    """``model=litgpt`` on a checkpoint folder, as it is (its vocabulary and fields)."""
    return ["model=litgpt", "model.name=null", f"model.path={assets / LITGPT_DIR}", "model.vocab_size=null",
            "model.config={}"]  # fmt: skip


@pytest.mark.parametrize("kind", ["text", "hf_text"])
def test_the_gpt_recipe_uses_a_litgpt_folders_tokenizer(tmp_path, assets, monkeypatch, kind):
    """train_gpt.py model=litgpt model.path=FOLDER: data=text and data=hf_text tokenized by LitGPT's tokenizer."""
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"{p} {a}" for p, a in instruction_pairs()))
    cfg = compose_gpt(*_folder_model(assets), f"data={kind}", f"data.path={text}", "data.global_batch_size=4")
    check_config(cfg)
    cache = open_token_cache(cfg.data.cache)
    assert cache.meta["kind"] == "hf_text" and cache.meta["vocab_size"] == 512
    assert cache.meta["tokenizer"] == str(assets / LITGPT_DIR)


def test_answers_from_litgpt_s_generation_with_a_kv_cache(assets):
    """Greedy answers through LitGPT's generate (KV cache) are those of a plain argmax loop over whole sequences;
    sampled ones are the same for the same seed."""
    tok, _ = load_tokenizer(assets / LITGPT_DIR)
    model = _gpt(assets / LITGPT_DIR)
    prompt = "What is 3 plus 4?"
    ids = tok.encode([tok.render_prompt(prompt)])[0]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    plain = tok.decode(ids[-6:])
    assert answer(model, tok, [prompt], max_new_tokens=6) == [plain] and tok.eos_id not in ids
    sampled = answer(model, tok, [prompt], max_new_tokens=6, temperature=1.0, seed=1)
    assert sampled == answer(model, tok, [prompt], max_new_tokens=6, temperature=1.0, seed=1) != [plain]


def test_a_short_litgpt_finetune_run(tmp_path, assets):
    """World 1, LitGPT's LoRA (peft=lora) on the tiny folder: trains, builds the token cache, saves the answers."""
    overrides = ["trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    got = run_recipe(FINETUNE, tmp_path, f"assets={assets}", "model=litgpt_chat_tiny", *overrides, "sample_tokens=4")
    _assert_finetuned(tmp_path / "run", got, steps=4, world=1)
    (cache,) = (tmp_path / "data" / "token_cache").iterdir()
    assert open_token_cache(cache).meta["kind"] == "sft" and 0 < got["trainable_params"] < got["frozen_params"]


@pytest.mark.slow
def test_litgpt_finetune_out_of_the_box(tmp_path, assets):
    """model=litgpt_chat_tiny with the recipe's defaults (200 steps): the loss falls far below a uniform guess."""
    got = run_recipe(FINETUNE, tmp_path, f"assets={assets}", "model=litgpt_chat_tiny", timeout=900)
    _assert_finetuned(tmp_path / "run", got, steps=200, world=1)
    assert got["final_val_loss"] < math.log(512) - 3  # far below a uniform guess over the vocabulary (6.2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["strategy=zero2"], ["strategy=hybrid3d", "strategy.pp=2", "peft=none"]],
    ids=["zero2-lora", "pp2"],
)
def test_litgpt_finetune_world_2(tmp_path, assets, layout):
    overrides = [*layout, "trainer.devices=2", "trainer.max_steps=10", "trainer.val_check_interval=5"]
    got = run_recipe(FINETUNE, tmp_path, f"assets={assets}", "model=litgpt_chat_tiny", *overrides)
    _assert_finetuned(tmp_path / "run", got, steps=10, world=2)


@pytest.mark.slow
def test_the_gpt_recipe_trains_and_samples_with_a_litgpt_folder(tmp_path, assets):
    output = gpt_recipe_with_a_tokenizer(tmp_path, *_folder_model(assets))
    assert "Tokenizer: LitGPT's tokenizer of the checkpoint folder" in output
