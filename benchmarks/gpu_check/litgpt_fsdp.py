"""Section 8: LitGPT's own full fine-tuning script (``litgpt.finetune.full.main``, unchanged) on the tiny LitGPT
checkpoint folder, a few steps at world 1, same seed, each run in its own process: under Lightning's
``FSDPStrategy`` built as the script's ``setup`` builds it (the reference the issue names) and under this package's
``Hybrid3DFabricStrategy(zero_stage=3)`` (ZeRO-3 over the one rank); both loss sequences (the script's logged loss at
each optimizer step) and their largest relative difference.

The runs are the test worker's (``tests/workers/run.py litgpt_script``: ``tests/test_litgpt_scripts.py`` runs the
same case at world 2 on CPU). Lightning's FSDPStrategy cannot run on CPU: Fabric's connector refuses it off the GPU
(``type(strategy) is FSDPStrategy`` with another accelerator), and torch's FSDP refuses a CPU module without a
``device_id`` (Lightning passes ``root_device.index``, None on CPU). The dry run therefore takes Lightning's DDP at
world 1 as the reference, through the same code otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_parallel.recipes.finetune_assets import make_default_assets

from .section import log

STEPS = 5


def run(config: dict[str, Any]) -> dict[str, Any]:
    dry, root = config["dry_run"], Path(config["root"])
    work = Path(config["work"]) / "litgpt_fsdp"
    assets = make_default_assets(work / "assets" / "finetune")[0].parent
    case = {"name": "full", "steps": STEPS, "global_batch": 4, "assets": str(assets)}
    reference = "ddp" if dry else "fsdp"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    losses = {}
    for label, spec in (("lightning", reference), ("ours", "hybrid3d:zero_stage=3")):
        out = work / label
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "tests/workers/run.py", "litgpt_script", "--strategy", spec, "--out", str(out)]
        cmd += ["--cases", json.dumps([case]), "--accelerator", "cpu" if dry else "gpu"]
        log(f"litgpt_fsdp: {label} ({spec})")
        timeout = max(10.0, config["deadline"] - time.monotonic() - 5.0)
        subprocess.run(cmd, cwd=root, env=env, check=True, timeout=timeout)
        losses[label] = json.loads((out / "rank0.json").read_text())[0]["losses"]
    pairs = list(zip(losses["lightning"], losses["ours"]))
    return {
        "script": "litgpt.finetune.full.main",
        "reference": "Lightning FSDPStrategy" if not dry else "Lightning DDP (FSDPStrategy needs a GPU)",
        "ours": "Hybrid3DFabricStrategy(zero_stage=3)",
        "steps": STEPS,
        "lightning_losses": losses["lightning"],
        "ours_losses": losses["ours"],
        "max_rel_diff": max(abs(a - b) / abs(a) for a, b in pairs) if pairs else None,
    }
