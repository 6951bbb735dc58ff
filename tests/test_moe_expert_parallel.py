"""Expert parallelism at ep=2 on both expert kernels, against one process: each rank draws only its experts' initial
values and gets one process's; outputs and gradients match; a forward and backward read the counts on the host
exactly once (the all-to-all's split sizes). This file is also the 2-rank worker (run as a script)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.expert import MoE, apply_expert_parallel

SEED, INIT_SEED, BATCH = 0, 7, 4  # BATCH samples of 5 tokens, split over the 2 ranks


def _layer(fused: bool) -> MoE:
    torch.manual_seed(SEED)
    moe = MoE(16, 32, 4, 2, activation="swiglu", aux_loss_coeff=0.0)  # aux off: a mean over samples per forward
    moe.experts.fused = fused
    return moe


def _inputs() -> torch.Tensor:
    return torch.randn(BATCH, 5, 16, generator=torch.Generator().manual_seed(1))


def _step(moe: MoE, x: torch.Tensor, watch=contextlib.nullcontext) -> dict[str, list]:
    """Initial values drawn, one forward and backward (inside ``watch``): what each rank reports."""
    moe.experts.reset_parameters(torch.Generator().manual_seed(INIT_SEED), std=0.3, out_std=0.3)
    init = {name: local(p).detach().tolist() for name, p in moe.experts.named_parameters()}
    with watch() as syncs:
        out = moe(x)
        out.square().sum().backward()
    grads = {name: local(p.grad).tolist() for name, p in moe.named_parameters()}
    return {"init": init, "out": out.detach().tolist(), "grads": grads, "syncs": syncs}


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_moe_kernels import host_syncs

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out_dir = parser.parse_args().out
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    result = {}
    for fused in (True, False):
        moe = _layer(fused)
        apply_expert_parallel(moe, mesh)
        x = _inputs().chunk(2)[rank]
        result[str(fused)] = _step(moe, x, host_syncs)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_expert_parallel_matches_one_process_on_both_kernels(tmp_path):
    from harness import run_distributed

    ranks = run_distributed(str(Path(__file__).resolve()), 2, [], tmp_path)
    for fused in (True, False):
        _check(fused, [r[str(fused)] for r in ranks], _step(_layer(fused), _inputs()))


def _check(fused: bool, ranks: list[dict], want: dict) -> None:
    rows = BATCH // 2
    for rank, got in enumerate(ranks):
        label = f"fused={fused} rank {rank}"
        assert got["syncs"] == ["Tensor.tolist"], f"{label}: {got['syncs']}"
        experts = slice(2 * rank, 2 * rank + 2)  # E / ep = 2 experts a rank
        for name, values in got["init"].items():  # drawn on the rank, only its experts
            assert torch.equal(torch.tensor(values), torch.tensor(want["init"][name])[experts]), f"{label} {name}"
        torch.testing.assert_close(
            torch.tensor(got["out"]), torch.tensor(want["out"][rank * rows : (rank + 1) * rows]), msg=label
        )
        for name, grad in got["grads"].items():
            if name.startswith("experts."):  # each expert's gradient gathers every rank's tokens
                torch.testing.assert_close(
                    torch.tensor(grad), torch.tensor(want["grads"][name])[experts], msg=f"{label} {name}"
                )
    router = sum(torch.tensor(r["grads"]["router.weight"]) for r in ranks)  # data-parallel: summed
    want_router = torch.tensor(want["grads"]["router.weight"])  # entries up to ~600: summed in another order
    torch.testing.assert_close(router, want_router, rtol=1e-5, atol=1e-4, msg=f"fused={fused} router")


if __name__ == "__main__":
    main()
