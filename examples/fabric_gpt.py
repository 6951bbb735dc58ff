"""Train the GPT with a plain Lightning Fabric loop under this package's strategies (the Trainer's names).

    python examples/fabric_gpt.py                                  # zero3 on 2 CPU processes
    python examples/fabric_gpt.py --strategy hybrid3d --tp 2 --devices 4 --save ckpt
    python examples/fabric_gpt.py --strategy zero2 --devices 2 --load ckpt   # any layout resumes the folder
    python examples/fabric_gpt.py --strategy hybrid3d --pp 2 --schedule zero_bubble --devices 2 --load ckpt

The loop is ordinary Fabric: ``fabric.setup``, ``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step``;
the strategy splits the model (on the meta device under ``fabric.init_module(empty_init=True)``: no rank ever holds
a whole copy under zero3 or tp), reduces the gradients once per step and writes sharded, layout-independent
checkpoints that the Trainer strategies resume too. Under ``--pp`` no rank holds the whole model: each micro-batch
runs through ``fabric.strategy.pipeline_step`` (every microbatch's forward and backward under the schedule).
Fabric starts the extra processes itself (it re-runs this script).
"""

from __future__ import annotations

import argparse

import lightning as L
from torch.utils.data import DataLoader

from lightning_parallel import Hybrid3DFabricStrategy  # importing the package registers the Fabric names
from lightning_parallel.models import GPTConfig, GPTModule, SyntheticTokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3", help="zero1, zero2, zero3, zero3_offload, hybrid3d, ...")
    parser.add_argument("--tp", type=int, default=1, help="hybrid3d: tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="hybrid3d: pipeline-parallel degree")
    parser.add_argument("--schedule", default="1f1b", help="hybrid3d under pp: gpipe, 1f1b, interleaved_1f1b, ...")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--save", help="a folder to write the sharded checkpoint to at the end")
    parser.add_argument("--load", help="a sharded checkpoint folder (Fabric's or the Trainer's) to resume from")
    args = parser.parse_args()

    pipeline = {"pp": args.pp, "pp_schedule": args.schedule} if args.pp > 1 else {}
    strategy = Hybrid3DFabricStrategy(tp=args.tp, **pipeline) if args.strategy == "hybrid3d" else args.strategy
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    config = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128)
    with fabric.init_module(empty_init=True):
        model = GPTModule(config, lr=3e-3)
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.load:
        fabric.load(args.load, state)

    data = SyntheticTokens(num_samples=4096, seq_len=config.seq_len, vocab_size=config.vocab_size, seed=0)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))  # split over the dp ranks
    batches, first = iter(loader), state["step"]
    for step in range(first, first + args.steps):
        for i in range(args.accumulate):
            idx, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=i < args.accumulate - 1):
                if args.pp > 1:  # forward and backward of every microbatch, under the schedule
                    loss = fabric.strategy.pipeline_step(model, idx, targets, scale=1 / args.accumulate)
                else:
                    loss = model.loss(model(idx), targets)
                    fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the whole model's norm, however split
        optimizer.step()
        optimizer.zero_grad()
        loss = fabric.all_reduce(loss.detach())  # the mean over the data-parallel ranks
        if step % 10 == 0 or step == first:
            fabric.print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.3f}")
    state["step"] = step + 1
    if args.save:
        fabric.save(args.save, state)
        fabric.print(f"saved {args.save}")


if __name__ == "__main__":
    main()
