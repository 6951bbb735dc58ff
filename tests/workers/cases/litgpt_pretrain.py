"""Worker: LitGPT's own pretraining script (``litgpt.pretrain.main``, unchanged) on the tiny LitGPT config and local
text (``TextBlocks`` over files written here, tokenized by the tiny folder's tokenizer), under one Fabric strategy;
writes rank<N>.json with the loss the script logs at each optimizer step, and ``<name>_params.pt`` on rank 0: the
final checkpoint (the script's ``out/final/lit_model.pth``) loaded into a fresh LitGPT ``GPT`` by its own
``load_state_dict``.

Strategy specs as :mod:`.litgpt_script`'s ("ddp": Lightning's, the one-process reference). Case keys: name, assets
(the folder ``make_default_assets`` wrote), steps (optimizer steps the run ends after), global_batch, dp (the
script's ``devices``: the data-parallel ranks), micro_batch (default 1), save_interval (the script's mid-run saves),
resume (a saved ``lit_model.pth`` of an earlier run of this launch, relative to the launch's folder: the script's
``resume``), compile (default True; False: the script's ``torch.compile`` runs eager), initial (start from the
tiny folder's ``lit_model.pth``: the script's ``initial_checkpoint_dir``).
The script stops at ``train.max_tokens``, counted per *process* (``max_tokens // world_size``): it is given for the
world's processes, so every layout makes the same number of steps. Its learning rate moves at every micro-batch
(warmup and decay count them): layouts compared keep the same micro-batches per step (the one-process run takes
``dp`` samples in each). LitGPT's ``save_hyperparameters`` (in every
``save_checkpoint``) needs its CLI extra, jsonargparse: where that is missing it is left out (it only records the
command line).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import lightning as L
import torch
from litgpt import GPT, Config, Tokenizer, pretrain
from litgpt.args import EvalArgs, TrainArgs

from lightning_parallel.checkpoint import consolidated
from lightning_parallel.litgpt.text_data import TextBlocks
from lightning_parallel.recipes.finetune_assets import LITGPT_DIR, write_texts

from .litgpt_script import Recorder, build_strategy

SEQ = 32  # the script's train.max_seq_length: blocks of 33 tokens


def final_params(path: Path, config: Config) -> dict[str, torch.Tensor]:
    """The script's final checkpoint in a fresh ``GPT``, by ``GPT.load_state_dict`` (strict): a folder (ours) once
    consolidated; a file (Lightning's) as LitGPT reads its own (the model under "model")."""
    whole = consolidated(path)["state_dict"] if path.is_dir() else torch.load(path, weights_only=True)["model"]
    model = GPT(config)
    model.load_state_dict(whole)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith((".cos", ".sin"))}


def run_case(case: dict, ctx) -> dict:
    os.environ.pop("PL_GLOBAL_SEED", None)  # as in .litgpt_script: a run before this one left its seed there
    if importlib.util.find_spec("jsonargparse") is None:
        pretrain.save_hyperparameters = lambda *args, **kwargs: None
    folder = Path(case["assets"]) / LITGPT_DIR
    config = Config.from_file(folder / "model_config.yaml")
    dp, steps, global_batch = case.get("dp", 1), case["steps"], case.get("global_batch", 4)
    recorder = Recorder()
    fabric = L.Fabric(accelerator="cpu", devices=ctx.world, strategy=build_strategy(ctx.strategy), precision="32-true")
    fabric._loggers = [recorder]
    micro = case.get("micro_batch", 1)
    iters = steps * global_batch // (dp * micro)  # the micro-batches of each process
    train = TrainArgs(
        save_interval=case.get("save_interval"),
        log_interval=1,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        lr_warmup_steps=1,
        max_tokens=iters * micro * SEQ * ctx.world,
        max_seq_length=SEQ,
        max_norm=1.0,
        min_lr=1e-4,
        tie_embeddings=False,
    )
    evals = EvalArgs(interval=10**6, max_iters=1, initial_validation=False, final_validation=True)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3, "eps": 1e-6}}  # eps: see .litgpt_script
    resume = ctx.out.parent / case["resume"] if case.get("resume") else False
    out = ctx.out / "run"
    data = TextBlocks(write_texts(ctx.out / "texts"))
    initial = folder if case.get("initial") else None  # continued pretraining: the script's fabric.load_raw
    args = (dp, 1337, initial, resume, config, data, out, folder, Tokenizer(folder), train, evals, optimizer)
    previous = torch._dynamo.config.disable
    torch._dynamo.config.disable = previous or not case.get("compile", True)  # the script's torch.compile runs eager
    try:
        fabric.launch(pretrain.main, *args)
    finally:
        torch._dynamo.config.disable = previous
    losses = [(int(row["step"]), row["loss"]) for row in recorder.rows if "loss" in row]
    if ctx.rank == 0 and ctx.strategy != "fsdp2":  # Lightning's FSDP2 folder: its losses are compared, not read
        torch.save(final_params(out / "final" / "lit_model.pth", config), ctx.out / f"{case['name']}_params.pt")
    fabric.barrier()
    return {"name": case["name"], "losses": [loss for _, loss in losses], "steps": [s for s, _ in losses]}
