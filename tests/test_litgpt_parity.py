"""LitGPTCausalLM (a GPT-NeoX-style GPT, and a Llama-style one with grouped-query attention) under zero3 and
hybrid3d: the same 10 AdamW steps as the plain LitGPT model trained in one process (``GPT.forward`` and litgpt's
own ``chunked_cross_entropy`` on shifted targets, no Lightning)."""

from __future__ import annotations

import pytest
import torch
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from torch.utils.data import DataLoader, DistributedSampler

litgpt_config = pytest.importorskip("litgpt.config")  # make install installs the litgpt extra
from litgpt.model import GPT  # noqa: E402
from litgpt.utils import chunked_cross_entropy, save_config  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ_LEN, LR, EPS = 10, 8, 16, 1e-3, 1e-6
SIZES = dict(block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2, n_embd=32, n_head=4)

# tp 2 divides heads (4), key/value groups (4 or 2) and the vocabulary (128); 2 blocks: pp up to 2
CONFIGS = {
    # pythia's layout (parallel residual, LayerNorm, biases, rotary on a quarter of each head), shrunk
    "neox": lambda: litgpt_config.Config.from_name("pythia-14m", intermediate_size=64, **SIZES),
    "llama": lambda: litgpt_config.Config(
        name="tiny-llama",
        n_query_groups=2,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
        **SIZES,
    ),
}

# label -> (world, strategy spec, model, tp); every run of one world size shares one launch. A label with
# "clip" clips the gradient norm at 0.05 (below the norms these steps have), with "accum" accumulates 2
# micro-batches per step, with "tuple" feeds (input_ids, labels) tuples.
FAST = {
    "llama zero1 clip": (2, "zero1", "llama", 1),
    "llama zero3": (2, "zero3", "llama", 1),
    "llama tp2 clip": (2, "hybrid3d:tp=2", "llama", 2),
    "llama tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "llama", 2),
    "llama pp2": (2, "hybrid3d:pp=2", "llama", 1),
    "neox pp2 interleaved_1f1b": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "neox", 1),
    "llama pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "llama", 2),
    "llama dp2 x tp2 zero3 accum": (4, "hybrid3d:tp=2,zero_stage=3", "llama", 2),
    "neox zero2 accum tuple": (4, "zero2", "neox", 1),
}
SLOW = {
    "llama pp2 gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "llama", 1),
    "llama pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama", 1),
    "neox zero3": (2, "zero3", "neox", 1),
    "neox tp2": (2, "hybrid3d:tp=2", "neox", 2),
    "neox tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "neox", 2),
    "neox pp2": (2, "hybrid3d:pp=2", "neox", 1),
    "neox dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "neox", 2),
    "neox pp2 x tp2 clip": (4, "hybrid3d:pp=2,tp=2", "neox", 2),
}
CLIP, ACCUMULATE = 0.05, 2


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Each tiny model written once as litgpt writes a checkpoint folder (model_config.yaml, lit_model.pth): the
    workers and the reference load the same weights."""
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = GPT(config())
        model.apply(model._init_weights)  # litgpt's own initialization (std 0.02)
        folder = tmp_path_factory.mktemp(f"litgpt_{name}")
        save_config(model.config, folder)
        torch.save(model.state_dict(), folder / "lit_model.pth")
        out[name] = str(folder)
    return out


def _options(label: str) -> dict:
    return {"clip": CLIP if "clip" in label else None, "accumulate": ACCUMULATE if "accum" in label else 1}


def _cases(folder: str, label: str) -> list[dict]:
    return [{"name": "train", "path": folder, "steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN,
             "lr": LR, "tuple_batch": "tuple" in label, **_options(label)}]  # fmt: skip


def _batch(tmp_path_factory, folders, runs: dict, tag: str) -> Batch:
    spec = {
        label: (world, strategy, _cases(folders[model], label)) for label, (world, strategy, model, _) in runs.items()
    }
    return Batch(tmp_path_factory, spec, tag=tag, worker="litgpt_worker.py")


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:
    return _batch(tmp_path_factory, folders, FAST, "litgpt")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:
    return _batch(tmp_path_factory, folders, SLOW, "litgpt_slow")


def plain_litgpt_training(folder: str, clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: LitGPT's GPT and loss (``chunked_cross_entropy`` of logits[:, :-1] against tokens[:, 1:], as
    litgpt's pretraining computes it), torch's AdamW with the same two groups, the batches in the order the
    workers' sampler gives the whole world; ``clip``: torch's norm clipping. (The workers' accumulated
    micro-batches make up the same global batch, with equal token counts: one batch here.)"""
    from lightning_parallel.litgpt import LitGPTCausalLM  # the defaults the workers train with

    model = GPT(litgpt_config.Config.from_file(f"{folder}/model_config.yaml"))
    model.load_state_dict(torch.load(f"{folder}/lit_model.pth", weights_only=True))
    defaults = LitGPTCausalLM.__init__.__defaults__  # lr, weight_decay, betas, eps
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": defaults[1]},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=defaults[2], eps=EPS)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (GLOBAL_BATCH * STEPS, SEQ_LEN), generator=g)
    sampler = DistributedSampler(range(len(tokens)), num_replicas=1, rank=0, shuffle=True, seed=0)
    losses = []
    for idx in DataLoader(list(range(len(tokens))), batch_size=GLOBAL_BATCH, sampler=sampler):
        batch = tokens[idx]
        loss = chunked_cross_entropy(model(batch)[:, :-1], batch[:, 1:], chunk_size=0)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def references(folders) -> dict[tuple[str, float | None], tuple[list[float], dict[str, torch.Tensor]]]:
    return {
        (name, clip): plain_litgpt_training(folder, clip) for name, folder in folders.items() for clip in (None, CLIP)
    }


def _check(runs: Batch, label: str, spec: tuple, references) -> None:
    world, strategy, model, tp = spec
    run = runs[label]
    want_losses, want_params = references[model, _options(label)["clip"]]
    dp = world // tp // (2 if "pp=2" in strategy else 1)
    leaders = [d * tp for d in range(dp)]  # one rank per dp index (tp ranks see the same batch)
    loss_rel = assert_same_losses(run.losses("train", leaders), want_losses, label)
    got = run.params("train")
    param_abs = assert_same_params(got, want_params, label)
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")


@pytest.mark.parametrize("label", list(FAST))
def test_litgpt_parity(label, fast_runs, references):
    _check(fast_runs, label, FAST[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_litgpt_parity_wider(label, slow_runs, references):
    _check(slow_runs, label, SLOW[label], references)


@pytest.mark.parametrize("model", list(CONFIGS))
def test_clipping_is_active_in_the_reference(model, references):
    """The "clip" cases test something: clipping at CLIP changes where the reference ends."""
    plain, clipped = references[model, None][1], references[model, CLIP][1]
    assert max((plain[k] - clipped[k]).abs().max().item() for k in plain) > 1e-3
