"""How long training is blocked per checkpoint save, ``async_save=True`` against a synchronous save: gpt_small
(about 10M parameters) under zero2 at world 2, a sharded save every ``EVERY`` steps, each in its own folder.

Blocked is the wall time of ``trainer.save_checkpoint`` on the slowest rank: the whole write when synchronous;
when asynchronous, the wait for the save before it (one in flight at a time) and the staging of a host copy.
The write of the last save, finished at teardown, is reported apart (``teardown_wait_s``). One launch per mode.

    python benchmarks/async_checkpoint.py [--out runs/bench/async_checkpoint]   # prints and writes results.json

Also the per-rank worker (run by :func:`run_async_checkpoint` with ``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 3  # saves at steps 3, 6, 9, 12: three after the first (the first has nothing to wait for)


def run_async_checkpoint(out: Path, run_distributed: Any, world: int = 2) -> dict[str, Any]:
    """Both modes, one launch each; rows of the slowest rank's median blocked seconds per save."""
    rows = {}
    for mode in ("sync", "async"):
        args = ["--worker", "--mode", mode, "--folder", str(out / f"ckpts_{mode}")]
        ranks = run_distributed(str(Path(__file__).resolve()), world, args, out / mode, timeout=900)
        blocked = [max(step) for step in zip(*(r["blocked_s"] for r in ranks))]
        rows[mode] = {
            "blocked_s_per_save": median(blocked[1:] or blocked),
            "blocked_s": blocked,
            "median_step_s": max(r["median_step_s"] for r in ranks),
            "teardown_wait_s": max(r["teardown_wait_s"] for r in ranks),
            "checkpoint_bytes": ranks[0]["checkpoint_bytes"],
        }
    rows["sync_over_async_blocked"] = rows["sync"]["blocked_s_per_save"] / rows["async"]["blocked_s_per_save"]
    return {"model": "gpt_small", "strategy": "zero2", "world": world, "every": EVERY, **rows}


def _worker(mode: str, folder: Path, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from hydra import compose, initialize_config_dir

    from lightning_parallel import ZeroStrategy
    from lightning_parallel.models import GPTModule, SyntheticTokens
    from lightning_parallel.recipes.config import register_configs
    from lightning_parallel.recipes.gpt import gpt_config

    class TimedSaves(pl.Callback):
        def __init__(self) -> None:
            self.blocked: list[float] = []
            self.steps: list[float] = []

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.steps.append(time.perf_counter() - self._start)
            if trainer.global_step % EVERY == 0:
                start = time.perf_counter()
                trainer.save_checkpoint(folder / f"step={trainer.global_step}.ckpt")
                self.blocked.append(time.perf_counter() - start)

        def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self._end = time.perf_counter()

    torch.set_num_threads(1)
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_gpt", overrides=["model=gpt_small"])
    pl.seed_everything(0, verbose=False)
    config, world = gpt_config(cfg.model), int(os.environ["WORLD_SIZE"])
    model = GPTModule(config, lr=cfg.model.lr, build_in_configure_model=True)
    data = SyntheticTokens(num_samples=8 * STEPS, seq_len=config.seq_len, vocab_size=config.vocab_size)
    loader = torch.utils.data.DataLoader(data, batch_size=8 // world)
    timer = TimedSaves()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ZeroStrategy(stage=2, async_save=mode == "async"),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        use_distributed_sampler=False,
    )
    trainer.fit(model, train_dataloaders=loader)
    teardown = time.perf_counter() - timer._end  # the last save's write, finished at teardown
    last = folder / f"step={STEPS}.ckpt"
    result = {
        "blocked_s": timer.blocked,
        "median_step_s": median(timer.steps[1:]),
        "teardown_wait_s": teardown,
        "checkpoint_bytes": sum(p.stat().st_size for p in last.iterdir()),
    }
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="(internal) one rank of one mode")
    parser.add_argument("--mode", choices=["sync", "async"])
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "async_checkpoint")
    args = parser.parse_args()
    if args.worker:
        return _worker(args.mode, args.folder, args.out)
    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_distributed

    results = run_async_checkpoint(args.out, run_distributed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k not in ("sync", "async")}))
    for mode in ("sync", "async"):
        row = results[mode]
        print(f"{mode}: blocked {row['blocked_s_per_save']:.3f} s/save, step {row['median_step_s']:.3f} s")


if __name__ == "__main__":
    main()
