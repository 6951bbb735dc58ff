"""The one test worker: runs the named case module of tests/workers/cases/ on this rank; writes rank<N>.json.

    run.py NAME --cases JSON [--strategy SPEC] --out DIR     # a list of cases: rank<N>.json is their results
    run.py NAME --runs-file FILE --out DIR                    # several runs (conftest's Batch), see below
    run.py NAME [--opts JSON] --out DIR                       # one case: rank<N>.json is its result

Run by tests/harness.py on N processes with torchrun's environment (or by tests/gpu/ as fresh interpreters). A
case module defines ``run_case(case: dict, ctx: Context) -> dict``; one that uses torch.distributed directly sets
``PROCESS_GROUP = True`` (this script makes the gloo world group first and releases every group at the end), and an
optional ``setup()`` runs once before the first case. ``--runs-file`` is a JSON ``[{label, strategy, cases}]``: every
run one after another in this process group, each run's results in ``OUT/<label>/rank<R>.json`` as soon as it ends,
the labels in ``OUT/rank<R>.json`` (the process start-up and the process group are paid once).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the cases package, however this script was started


@dataclass(frozen=True)
class Context:
    """What a case runs in: the world, this rank, its output folder, the run's strategy spec and accelerator."""

    world: int
    rank: int
    out: Path
    strategy: str | None = None
    accelerator: str = "cpu"


def _write(folder: Path, rank: int, result: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(result))


def run(module, args: argparse.Namespace, ctx: Context) -> None:
    if args.runs_file:
        runs = json.loads(Path(args.runs_file).read_text())
        for spec in runs:
            run_ctx = replace(ctx, out=ctx.out / spec["label"], strategy=spec["strategy"])
            run_ctx.out.mkdir(parents=True, exist_ok=True)
            _write(run_ctx.out, ctx.rank, [module.run_case(case, run_ctx) for case in spec["cases"]])
        _write(ctx.out, ctx.rank, [spec["label"] for spec in runs])
    elif args.cases is not None:
        _write(ctx.out, ctx.rank, [module.run_case(case, ctx) for case in json.loads(args.cases)])
    else:
        _write(ctx.out, ctx.rank, module.run_case(json.loads(args.opts), ctx))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", help="a module of tests/workers/cases/")
    parser.add_argument("--cases", help="JSON list of cases")
    parser.add_argument("--runs-file", help="JSON file of [{label, strategy, cases}], each writing into OUT/<label>/")
    parser.add_argument("--opts", default="{}", help="JSON object: the one case")
    parser.add_argument("--strategy", help="the strategy spec of --cases (cases/common.py's build_strategy)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL: tests/gpu/)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    module = importlib.import_module(f"cases.{args.name}")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    if hasattr(module, "setup"):
        module.setup()
    if getattr(module, "PROCESS_GROUP", False):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        from lightning_parallel.parallel import strict

        strict.enable_from_env()  # as the strategies do (the harness sets LP_STRICT_COLLECTIVES=1)
    run(module, args, Context(world, rank, Path(args.out), args.strategy, args.accelerator))
    if getattr(module, "PROCESS_GROUP", False):
        from lightning_parallel.parallel.shutdown import release_process_groups

        release_process_groups()  # plain torch.distributed: the script releases what it made


if __name__ == "__main__":
    main()
