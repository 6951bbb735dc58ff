"""One section in this (fresh) interpreter: ``python -m benchmarks.gpu_check.section NAME CONFIG RESULT LIMIT``.

Writes the section's result dict to RESULT as JSON; a section that raises writes nothing (the parent records its
output's tail). Modules are imported here, per section, so a missing name fails only its own section.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

RUNNERS = {  # section -> module:function(config, limit_s) -> dict
    "environment": "benchmarks.gpu_check.environment:run",
    "gpu_tier": "benchmarks.gpu_check.tier:run",
    "kernels": "benchmarks.gpu_check.kernels:run",
    "mfu_plain": "benchmarks.gpu_check.mfu:run_plain",
    "mfu_lightning": "benchmarks.gpu_check.mfu:run_lightning",
    "mfu_ours": "benchmarks.gpu_check.mfu:run_ours",
    "memory": "benchmarks.gpu_check.memory:run",
    "litgpt_fsdp": "benchmarks.gpu_check.litgpt_fsdp:run",
    "fp8": "benchmarks.gpu_check.fp8:run",
}


def log(message: str) -> None:
    """A timestamped progress line in the section's log."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str]) -> int:
    name, config_file, result_file, limit = argv[0], Path(argv[1]), Path(argv[2]), float(argv[3])
    config: dict[str, Any] = json.loads(config_file.read_text())
    config["deadline"] = time.monotonic() + limit
    module, function = RUNNERS[name].split(":")
    result = getattr(importlib.import_module(module), function)(config)
    result_file.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
