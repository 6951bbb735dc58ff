"""Sharded checkpoints outside training: turn one into an ordinary file, or look inside it.

    python -m lightning_parallel.checkpoint consolidate CKPT_DIR OUT.pt   # one file for plain Lightning
    python -m lightning_parallel.checkpoint info CKPT_DIR                 # step, tensors, bytes
    python -m lightning_parallel.checkpoint export-hf CKPT OUT_DIR        # HFCausalLM: a save_pretrained folder
    python -m lightning_parallel.checkpoint export-hf CKPT OUT_DIR --merge  # with LoRA: base + adapters merged
    python -m lightning_parallel.checkpoint export-peft CKPT OUT_DIR      # with LoRA: a folder peft loads

The file ``consolidate`` writes is the checkpoint a single-process Lightning run would have written:
``state_dict`` by parameter name, ``optimizer_states`` numbered like ``Optimizer.state_dict()``, and the
loops, schedulers and callbacks as saved. ``Trainer.fit(ckpt_path=OUT.pt)`` resumes from it with any
strategy, and ``module.load_state_dict(torch.load(OUT.pt)["state_dict"])`` loads the weights alone.
A one-file checkpoint (Lightning's own, or ``checkpoint_format="full"``) passes through as it is.
Nothing is executed from a checkpoint while reading it (see ``parallel/checkpoint/files.py``); the functions are
``parallel/checkpoint/consolidate.py``'s.
"""

from __future__ import annotations

import argparse
import sys

from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.parallel.checkpoint.consolidate import (  # noqa: F401  (public here)
    check_checkpoint_path,
    consolidate,
    consolidated,
    info,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("consolidate", help="write a sharded checkpoint folder as one ordinary file")
    c.add_argument("ckpt_dir")
    c.add_argument("out")
    i = commands.add_parser("info", help="what a sharded checkpoint holds")
    i.add_argument("ckpt_dir")
    e = commands.add_parser("export-hf", help="an HFCausalLM checkpoint as a folder from_pretrained loads")
    e.add_argument("ckpt")
    e.add_argument("out_dir")
    e.add_argument("--config", help="a folder with the model's config.json, for a checkpoint that holds none")
    e.add_argument("--merge", action="store_true", help="LoRA: merge the adapters into the base the checkpoint names")
    e.add_argument("--base", help="LoRA with --merge: the base's folder, if not where the checkpoint says")
    p = commands.add_parser("export-peft", help="LoRA adapters as a folder PeftModel.from_pretrained loads")
    p.add_argument("ckpt")
    p.add_argument("out_dir")
    p.add_argument("--config", help="a folder with the base's config.json, for a checkpoint that holds none")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            print(f"wrote {consolidate(args.ckpt_dir, args.out)}")
        elif args.command == "export-hf":
            from lightning_parallel.hf.export import export_hf  # needs transformers (the hf extra)

            print(f"wrote {export_hf(args.ckpt, args.out_dir, args.config, merge=args.merge, base=args.base)}")
        elif args.command == "export-peft":
            from lightning_parallel.hf.export import export_peft  # needs peft (the peft extra)

            print(f"wrote {export_peft(args.ckpt, args.out_dir, args.config)}")
        else:
            print(info(args.ckpt_dir))
    except (FileNotFoundError, ValueError, checkpoint_io.UnsafeCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
