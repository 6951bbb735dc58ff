"""Host syncs: the counter (lightning_parallel/parallel/measure/host_sync.py) finds each kind of call that would make
the host wait for a GPU and leaves host tensors alone; a training step of the package adds none beyond Lightning's
own (benchmarks/host_syncs.py: the recipe's GPT and an HF Llama under bf16-mixed at world 2, with the recipe's
callbacks), fast for two layouts, every layout of the table in the slow tier."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed

from lightning_parallel.parallel.measure.host_sync import HostSyncCounter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.host_syncs import MODELS, STEPS, WARMUP, run_host_syncs  # noqa: E402

WORKER = ROOT / "benchmarks" / "worker.py"
HERE = "tests/test_host_sync.py"


def _kinds(counter: HostSyncCounter) -> list[tuple[str, str]]:
    return [(e.kind, e.call) for e in counter.events]


def test_each_kind_of_sync_is_counted_at_its_line():
    dev = torch.ones(4, device=torch.device("cpu"))  # a device tensor: made for the run's device
    with HostSyncCounter() as counter:
        int(dev.sum())
        dev.tolist()
        dev.cpu()
        dev[dev > 0]
        dev.nonzero()
        torch.tensor([1, 2], device=dev.device)
        torch.arange(4).to(dev.device)
    assert _kinds(counter) == [
        ("item", "Tensor.__int__"),
        ("item", "Tensor.tolist"),
        ("to_host", "Tensor.cpu"),
        ("data_dependent_shape", "aten.index.Tensor"),
        ("data_dependent_shape", "aten.nonzero.default"),
        ("host_to_device", "torch.tensor(device=...)"),
        ("host_to_device", "Tensor.to"),
    ]
    lines = [int(e.site.rsplit(":", 1)[1]) for e in counter.events]
    assert all(e.site.split(":")[0].endswith(HERE) and e.package == "other" for e in counter.events), counter.events
    assert lines == sorted(lines) and len(set(lines)) == 7, lines  # each at its own line


def test_host_tensors_and_syncfree_idioms_are_not_counted():
    """Tensors made without a device stay on the host on a GPU too (reading them waits for nothing), as do torch
    optimizers' step counters; ``x[mask] = 0`` is a masked_fill; a device tensor copied once is not copied again."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    p.sum().backward()
    opt.step()
    dev = torch.ones(4, device=torch.device("cpu"))
    with HostSyncCounter() as counter:
        host = torch.arange(4)
        (host * 2).tolist()
        int(host.sum())
        dev[dev > 2] = 0
        dev.masked_fill_(dev > 2, 1.0)
        p.sum().backward()
        opt.step()  # AdamW reads its step counter with .item(): a host tensor
    assert counter.events == []


def _syncs(tmp_path: Path, model: list[str], spec: str) -> list[dict]:
    cli = ["--recipe", "gpt", "--overrides", json.dumps(model), "--strategy", spec]
    cli += ["--steps", str(WARMUP + STEPS + 3), "--warmup", str(WARMUP), "--syncs", str(STEPS)]
    return [r["host_syncs"] for r in run_distributed(str(WORKER), 2, cli, tmp_path, timeout=600)]


def _ours(ranks: list[dict]) -> list[dict]:
    return [s for r in ranks for s in r["sites"] if s["package"] == "lightning_parallel"]


@pytest.mark.parametrize(
    "model, spec",
    [("hf_llama", "hybrid3d:pp=2,pp_schedule=1f1b,microbatches=2"), ("gpt", "hybrid3d:tp=2,sequence_parallel=true")],
)
def test_a_step_adds_no_host_sync(tmp_path, model, spec):
    """The package's own calls in a steady step: none (its preemption check, token normalisation, pipeline, tp and
    HF stage code included); what remains is Lightning's and transformers' (named in BENCHMARKS.md)."""
    ranks = _syncs(tmp_path, MODELS[model], spec)
    assert all(r["steps"] == 2 for r in ranks), ranks
    assert _ours(ranks) == [], _ours(ranks)
    # the counter saw the step: Lightning's SIGTERM broadcast read with .item() on every rank, every step
    assert all(any("training_epoch_loop" in s["site"] for s in r["sites"]) for r in ranks), ranks


@pytest.mark.slow
def test_no_layout_syncs_more_than_lightnings_own(tmp_path):
    """The whole table (benchmarks/host_syncs.py): for both models and every layout, none of the package's own but
    fp16's named skip decision, every remaining one named, and per rank no more than Lightning's ``ddp`` on the same
    model and recipe."""

    def launch(recipe, overrides, world, spec, out, steps, **kw):
        tag = spec.replace(":", "_").replace(",", "_").replace("=", "") + kw["tag"]
        cli = ["--recipe", recipe, "--overrides", json.dumps(overrides), "--strategy", spec, "--steps", str(steps)]
        cli += ["--warmup", str(kw["warmup"]), "--syncs", str(kw["syncs"])]
        return run_distributed(str(WORKER), world, cli, out / tag, timeout=600)

    rows = run_host_syncs(tmp_path, launch)
    for row in rows:
        ddp = next(r for r in rows if r["model"] == row["model"] and r["spec"] == "ddp")
        ours = [s for s in row["sites"] if s["package"] == "lightning_parallel"]
        # the one named sync of ours: fp16's skip decision (Lightning's GradScaler reads the same)
        named = row["model"] == "gpt_fp16" and all("loss_scaler.py" in s["site"] and s["per_step"] == 1 for s in ours)
        assert not ours or named, row
        assert all(s["reason"] for s in row["sites"]), row  # every remaining sync named
        assert all(a <= b for a, b in zip(row["per_step"], ddp["per_step"])), (row, ddp)
