"""The Python packages the check needs beside torch, installed if missing (before any section starts).

A GPU machine lent here has a CUDA torch but may lack the recipes' config packages and has no network: wheels in
``.whl/`` at the repository root (``make gpu-wheels`` downloads them; the device call carries the folder) are
installed from there, else pip tries its index. torch itself is never touched here (the Makefile's `gpu-check`
installs a CUDA torch when there is none).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

# import name -> pip requirement (the pyproject pins, loosest where the package's own range allows)
NEEDED = {
    "lightning": "lightning>=2.6,<2.7",
    "torchmetrics": "torchmetrics>=1.4",
    "omegaconf": "omegaconf>=2.3",
    "hydra": "hydra-core>=1.3",
    "matplotlib": "matplotlib>=3.8",
    "pytest": "pytest>=8",
    "yaml": "pyyaml",
}


def missing() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def ensure_packages(root: Path) -> dict[str, Any]:
    """Install what is missing; returns what was missing, how it was installed and what is still missing."""
    absent = missing()
    record: dict[str, Any] = {"python": sys.executable, "missing": absent}
    if not absent:
        return record
    wheels = root / ".whl"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if wheels.is_dir():
        cmd += ["--no-index", "--find-links", str(wheels)]
    else:
        cmd += ["--timeout", "15", "--retries", "0"]
    cmd += [NEEDED[name] for name in absent]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        record["pip"] = {"command": " ".join(cmd), "returncode": done.returncode, "output": done.stderr[-2000:]}
    except subprocess.TimeoutExpired:
        record["pip"] = {"command": " ".join(cmd), "returncode": None, "output": "timed out after 120 s"}
    importlib.invalidate_caches()
    record["still_missing"] = missing()
    return record
