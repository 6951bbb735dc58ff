"""The Python packages the check needs beside torch: carried as wheels, installed offline, never from a network.

The lent GPU machine (one H200, Python 3.12, torch 2.11 + CUDA 13) has no network at all. ``make gpu-wheels`` runs
``python -m benchmarks.gpu_check.deps --gather .whl`` here: every pure-Python wheel in :data:`CARRIED` into ``.whl/``
at the repository root (antlr4's sdist built into a wheel), under the 64 MiB a device call carries; the call carries
the folder (``carry=[".whl"]``). Before any section starts, :func:`ensure_packages` installs each carried package
whose import is missing, or whose installed version is outside its range, with ``pip install --no-index
--find-links .whl --no-deps --target WORK/site`` (the image's own site-packages stay as they are; WORK/site goes first
on the sections' PYTHONPATH). Nothing here can reach an index: a package still missing afterwards is reported, and
the sections that need it (:data:`NEEDS`) are skipped with that reason instead of failing or waiting.

:data:`IMAGE` are the packages the device image has (the device notes' package list): checked, never carried; torch
itself is never touched here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# import name -> (distribution, pip requirement): gathered into .whl/ by `make gpu-wheels`. The pins are the versions
# this repository is verified with (pyproject, the Makefile's LITGPT_VERSION); lightning's range keeps the image's
# own lightning when it has one in range (the image lists the package without a version: carried to be sure)
CARRIED = {
    "hydra": ("hydra-core", "hydra-core==1.3.8"),
    "omegaconf": ("omegaconf", "omegaconf==2.3.1"),
    "antlr4": ("antlr4-python3-runtime", "antlr4-python3-runtime==4.9.3"),  # an sdist on PyPI: built into a wheel
    "litgpt": ("litgpt", "litgpt==0.5.13"),
    "lightning": ("lightning", "lightning>=2.6,<2.7"),
    "torchao": ("torchao", "torchao==0.18.0"),  # the fp8 section; a cp310-abi3 wheel (its float8 is pure Python)
}
BINARY = {"torchao"}  # carried although not pure Python: its float8 training needs none of its compiled kernels
GATHER_PINS = {"lightning": "lightning==2.6.6"}  # the version downloaded for a range above
SDISTS = {"antlr4"}
# import name -> distribution: on the device image already (its package list), checked and reported, not carried
IMAGE = {
    "yaml": "pyyaml",
    "pytest": "pytest",
    "torchmetrics": "torchmetrics",
    "lightning_utilities": "lightning-utilities",
    "pytorch_lightning": "pytorch-lightning",
    "matplotlib": "matplotlib",
    "numpy": "numpy",
    "psutil": "psutil",
    "huggingface_hub": "huggingface-hub",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "tqdm": "tqdm",
    "transformers": "transformers",  # the LitGPT assets' tokenizer (recipes/finetune_assets.py)
}
_BASE = ["lightning", "yaml", "torchmetrics", "lightning_utilities"]  # `import lightning_parallel`'s
_RECIPES = ["hydra", "omegaconf", "antlr4"]  # the recipes, the planner (plan.py imports omegaconf)
# section -> the imports it needs (environment needs torch alone: it reports what is missing)
NEEDS = {
    "environment": [],
    "gpu_tier": ["pytest", *_BASE, *_RECIPES, "matplotlib"],
    "kernels": _BASE,
    "mfu_plain": _BASE,
    "mfu_lightning": _BASE,
    "mfu_ours": _BASE,
    "memory": [*_BASE, *_RECIPES],
    "fp8": [*_BASE, "torchao", "transformers"],
    "litgpt_fsdp": [*_BASE, "litgpt", "psutil", "huggingface_hub", "safetensors", "tokenizers", "tqdm", "transformers"],
}
LIMIT_BYTES = 64 * 2**20  # what one device call carries, the working tree included
PIP_TIMEOUT_S = 60  # one offline install from local wheels: seconds, never a network wait


def _satisfied(name: str) -> bool:
    """The import is found and, for a carried package, its installed version is in the requirement's range."""
    if importlib.util.find_spec(name) is None:
        return False
    if name not in CARRIED:
        return True
    dist, requirement = CARRIED[name]
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no packaging: found is good enough
        return True
    versions = [d.version for d in importlib.metadata.distributions() if _name(d.metadata["Name"]) == _name(dist)]
    return bool(versions) and Requirement(requirement).specifier.contains(versions[0], prereleases=True)


def _name(dist: str | None) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", dist or "").lower()


def missing() -> list[str]:
    """Import names (carried and the image's) that are not there, or out of range."""
    return [name for name in [*CARRIED, *IMAGE] if not _satisfied(name)]


def wheel_for(wheels: Path, name: str) -> Path | None:
    dist = CARRIED[name][0].replace("-", "_").lower()
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(dist + "-"))
    return found[-1] if found else None


def ensure_packages(root: Path, site: Path) -> dict[str, Any]:
    """Install each carried package that is missing from ``.whl/`` into ``site``, offline; what is still missing.

    Returns:
        ``missing`` (before), ``installed`` (name -> the pip command's outcome), ``still_missing`` (name -> why), and
        ``site`` (put first on the sections' PYTHONPATH).
    """
    wheels = root / ".whl"
    site.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(site))  # what lands there is found by the checks below (and first for the sections)
    importlib.invalidate_caches()
    absent = missing()
    record: dict[str, Any] = {"python": sys.executable, "missing": absent, "site": str(site), "installed": {}}
    why: dict[str, str] = {}
    for name in absent:
        if name in IMAGE:
            why[name] = f"{IMAGE[name]} is not installed and is not carried (the device image lists it)"
            continue
        wheel = wheel_for(wheels, name) if wheels.is_dir() else None
        if wheel is None:
            why[name] = f"no {CARRIED[name][0]} wheel in {wheels}: run `make gpu-wheels` here, carry .whl"
            continue
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
        cmd += ["--no-deps", "--no-compile", "--find-links", str(wheels), "--target", str(site), "--upgrade"]
        cmd.append(str(wheel))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=offline_env())
            record["installed"][name] = {"wheel": wheel.name, "returncode": done.returncode,
                                         "output": done.stderr[-1000:]}  # fmt: skip
        except subprocess.TimeoutExpired:
            record["installed"][name] = {"wheel": wheel.name, "returncode": None, "output": "timed out"}
    importlib.invalidate_caches()
    for name in absent:
        if name not in why and not _satisfied(name):
            why[name] = f"{CARRIED[name][0]}: the offline install from .whl failed: {record['installed'].get(name)}"
    record["still_missing"] = why
    return record


def offline_env() -> dict[str, str]:
    """pip with every index switched off and proxies pointing nowhere: a missing wheel fails at once."""
    import os

    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    return env | {k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}


def skip_reason(section: str, still_missing: dict[str, str]) -> str | None:
    """Why ``section`` cannot run (its packages that are still missing), or None."""
    gone = [name for name in NEEDS.get(section, []) if name in still_missing]
    return "; ".join(f"{name}: {still_missing[name]}" for name in gone) or None


def gather(folder: Path) -> dict[str, int]:
    """Download every carried wheel (built from the sdist where PyPI has no wheel) into ``folder``: name -> bytes.
    Needs an index (here, never on the device); raises when the folder outgrows :data:`LIMIT_BYTES`."""
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    pins = [GATHER_PINS.get(name, req) for name, (_, req) in CARRIED.items() if name not in SDISTS]
    target = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64"]
    subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", *target, "-d", str(folder), *pins],
                   check=True)  # fmt: skip
    for name in SDISTS:
        if wheel_for(folder, name) is None:
            subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(folder), CARRIED[name][1]], check=True)
    sizes = {p.name: p.stat().st_size for p in sorted(folder.glob("*.whl"))}
    for name in CARRIED:
        if wheel_for(folder, name) is None:
            raise SystemExit(f"gpu-wheels: no wheel for {CARRIED[name][0]} in {folder}")
        if name not in BINARY and not wheel_for(folder, name).name.endswith("-none-any.whl"):  # type: ignore[union-attr]
            raise SystemExit(f"gpu-wheels: {wheel_for(folder, name)} is not pure Python: pin one for cp312 x86_64")
    if sum(sizes.values()) > LIMIT_BYTES:
        raise SystemExit(f"gpu-wheels: {sum(sizes.values())} bytes in {folder}, over the {LIMIT_BYTES} a call carries")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.deps", description=__doc__.split("\n")[0])
    p.add_argument("--gather", type=Path, required=True, help="the folder to download the wheels into (.whl)")
    sizes = gather(p.parse_args(argv).gather)
    for name, size in sizes.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{sum(sizes.values()) / 2**20:8.2f} MiB in {len(sizes)} wheels (a device call carries at most 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
