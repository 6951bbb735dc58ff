"""Peak memory per rank while a pretrained Hugging Face folder is loaded under hybrid3d pp=2 x tp=2 (world 4):
HFCausalLM's default (parameters on meta, each rank reads its slices after the split) against
``lazy_load=False`` (``from_pretrained`` in every rank, then split).

    python benchmarks/hf_load_memory.py [--hidden 1024 --layers 8 --vocab 32000]

Writes a random-init Llama (grouped-query attention) with ``save_pretrained`` into a temporary folder, then for
each mode launches 4 CPU/gloo processes that build the module and run the strategy's setup up to the first
training step. Each rank reports its peak resident memory growth (``ru_maxrss`` from after the imports to the
start of training: model build, split and load, before any optimizer state exists), the bytes it read from the
folder and the bytes of the parameters it holds. A table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(folder: str, lazy: bool, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM  # noqa: F401  (the model's code imported before the baseline)

    from lightning_parallel import Hybrid3DStrategy
    from lightning_parallel.hf import HFCausalLM

    baseline = rss_bytes()  # after the imports
    torch.set_num_threads(1)

    class Measure(pl.Callback):
        def on_train_start(self, trainer, module) -> None:
            held = sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in module.parameters()
            )
            rank = trainer.global_rank
            result = {"peak_growth": rss_bytes() - baseline, "read": module.weight_bytes_read, "held": held}
            (out / f"rank{rank}.json").write_text(json.dumps(result))
            trainer.should_stop = True

    module = HFCausalLM(folder, lazy_load=lazy)
    ids = torch.zeros(8, 16, dtype=torch.long)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=Hybrid3DStrategy(pp=2, tp=2, microbatches=2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Measure()],
    )
    trainer.fit(module, torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worker", nargs=3, metavar=("FOLDER", "LAZY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        folder, lazy, out = args.worker
        return worker(folder, lazy == "1", Path(out))
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        print(f"Llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {full / 2**20:.0f} MiB (fp32)")
        print("| loading | rank | peak RSS growth MiB | read from folder MiB | parameters held MiB |")
        print("|---|---|---|---|---|")
        for lazy in (True, False):
            out = Path(tmp) / f"out{int(lazy)}"
            out.mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", __file__]
            cmd += ["--worker", str(folder), str(int(lazy)), str(out)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
            name = "after the split (default)" if lazy else "lazy_load=False"
            for rank in range(4):
                r = json.loads((out / f"rank{rank}.json").read_text())
                mib = [r[k] / 2**20 for k in ("peak_growth", "read", "held")]
                print(f"| {name} | {rank} | {mib[0]:.0f} | {mib[1]:.0f} | {mib[2]:.0f} |")
        print(f"(a full copy: {full / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
