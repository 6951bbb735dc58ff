"""The device call rehearsed on a CPU: ``make gpu-check`` (its dry run) under the device's torch and Python, with the
device image's packages and nothing else, the network blocked, the carried packages installed from ``.whl/`` alone.

- ``python -m benchmarks.gpu_check.rehearsal env`` (``make gpu-rehearsal-env``): builds, once, a virtual environment
  outside the repository (``LP_GPU_REHEARSAL_ENV``, default ``~/.cache/lightning-parallel/gpu-rehearsal``): Python
  3.12 where this machine has one, torch 2.11.0 as PyPI serves it (the CUDA 13 build with its nvidia libraries: it
  imports and runs on a CPU, ``torch.cuda.is_available()`` False; PyPI has no CPU build) and :data:`IMAGE_PACKAGES`,
  the packages of the device image that the check imports (hydra, omegaconf, antlr4, litgpt and lightning are not
  among them: they come from ``.whl/``). About 5 GB on disk; measured 45 s to install torch 2.11 with its nvidia
  packages here. A marker file holds the recipe: a changed recipe rebuilds it.
- ``python -m benchmarks.gpu_check.rehearsal run --out DIR`` (``make gpu-rehearsal``; tests/test_gpu_check.py's slow
  rehearsal): gathers ``.whl/`` if a wheel is missing (``make gpu-wheels``, with the network), then in a network
  namespace of its own (``unshare -n``, the loopback alone up: the check's process groups need 127.0.0.1) proves the
  block (the index's name does not resolve and ``pip download`` fails) and runs ``make gpu-check
  GPU_CHECK_ARGS=--dry-run`` with the environment's Python, pip's configuration switched off (``PIP_CONFIG_FILE``)
  and ``PIP_NO_INDEX=1``. Where ``unshare -n`` is refused (not root), proxies pointing nowhere and
  ``PIP_NO_INDEX=1`` are the block, and the probe shows that pip fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.11.0"  # the device's (2.11.0+cu130)
# the device image's packages that the check and what it runs import, at the image's versions where its notes give one
IMAGE_PACKAGES = [
    "numpy", "pyyaml", "pytest", "matplotlib", "torchmetrics==1.9.0", "pytorch-lightning==2.6.6",
    "lightning-utilities", "huggingface-hub==1.33.0", "safetensors==0.8.0", "tokenizers==0.23.2", "tqdm",
    "psutil", "packaging", "jinja2", "typing-extensions", "filelock", "fsspec", "transformers==5.17.0",
]  # fmt: skip
PROBE = """
import json, socket, subprocess, sys, tempfile
out = {}
try:
    socket.getaddrinfo("pypi.org", 443)
    out["dns"] = "resolved"
except OSError as err:
    out["dns"] = f"{type(err).__name__}: {err}"
cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tempfile.mkdtemp(), "--timeout", "5",
       "--retries", "0", "--index-url", "https://pypi.org/simple", "--no-cache-dir", "six"]
done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
out["pip_download_returncode"] = done.returncode
out["pip_download_tail"] = (done.stdout + done.stderr)[-300:]
print("PROBE " + json.dumps(out), flush=True)
sys.exit(0 if done.returncode != 0 else 3)
"""


def env_dir() -> Path:
    default = Path.home() / ".cache" / "lightning-parallel" / "gpu-rehearsal"
    return Path(os.environ.get("LP_GPU_REHEARSAL_ENV", default))


def find_python312() -> str:
    """A working Python 3.12 (the device's), else this interpreter (the rehearsal then says which it ran)."""
    found = [os.environ.get("LP_GPU_REHEARSAL_PYTHON"), shutil.which("python3.12")]
    found += sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / "3.12*" / "bin" / "python3.12")))
    found += ["/usr/bin/python3.12", "/usr/local/bin/python3.12"]
    for candidate in filter(None, found):
        try:
            done = subprocess.run([candidate, "-c", "import sys, venv; print(sys.version_info[:2])"],
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
        except OSError:
            continue
        if done.returncode == 0 and done.stdout.strip() == "(3, 12)":
            return candidate
    return sys.executable


def build_env(folder: Path | None = None) -> dict[str, Any]:
    """The cached environment, built when missing or made from another recipe: its python, and the seconds it took.
    One build at a time (a lock file beside the folder): a second caller waits for the first and reuses its build."""
    import fcntl

    folder = folder or env_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_env(folder)


def _build_env(folder: Path) -> dict[str, Any]:
    marker, python = folder / "rehearsal.json", folder / "bin" / "python"
    recipe = {"torch": TORCH, "packages": IMAGE_PACKAGES}
    if marker.is_file() and python.is_file() and json.loads(marker.read_text()).get("recipe") == recipe:
        return json.loads(marker.read_text()) | {"built_now": False}
    began = time.monotonic()
    shutil.rmtree(folder, ignore_errors=True)
    base = find_python312()
    subprocess.run([base, "-m", "venv", str(folder)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH, *IMAGE_PACKAGES], check=True, timeout=1800)
    version = subprocess.run([str(python), "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    info = {"recipe": recipe, "python": str(python), "python_version": version[0], "torch": version[1]}
    info["build_seconds"] = round(time.monotonic() - began, 1)
    marker.write_text(json.dumps(info, indent=1))
    return info | {"built_now": True}


def network_block() -> tuple[list[str], str]:
    """The command prefix that cuts the child off the network, and its name: a network namespace of its own with only
    the loopback up where ``unshare -n`` works here, else nothing (the proxies and PIP_NO_INDEX remain)."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    works = unshare and ip and subprocess.run([unshare, "-n", ip, "link", "set", "lo", "up"], capture_output=True)
    if works and works.returncode == 0:
        return [unshare, "-n", "sh", "-c", f'"{ip}" link set lo up && exec "$@"', "sh"], "unshare -n (loopback only)"
    return [], "proxies to 127.0.0.1:9 and PIP_NO_INDEX=1"


def child_env(python: str) -> dict[str, str]:
    """The environment of the rehearsed call: the venv first on PATH, nothing of this machine's Python or pip setup."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    proxies = {k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    bin_dir = str(Path(python).parent)
    venv = {"PATH": bin_dir + os.pathsep + keep.get("PATH", ""), "VIRTUAL_ENV": str(Path(bin_dir).parent)}
    pip = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "NO_PROXY": "127.0.0.1,localhost"}
    return keep | proxies | venv | pip


def rehearse(out: Path, work: Path) -> dict[str, Any]:
    """Build or reuse the environment, gather .whl/ if incomplete, then the blocked dry run; what happened, timed."""
    from .deps import CARRIED, gather, wheel_for

    began = time.monotonic()
    info = build_env()
    wheels = ROOT / ".whl"
    if not wheels.is_dir() or any(wheel_for(wheels, name) is None for name in CARRIED):
        gather(wheels)  # `make gpu-wheels`: here, with the network, before the block
    prefix, block = network_block()
    env = child_env(info["python"])
    out.mkdir(parents=True, exist_ok=True)
    probe_env = {k: v for k, v in env.items() if k != "PIP_NO_INDEX"}  # the probe's pip may try: the block must stop it
    probe = subprocess.run([*prefix, info["python"], "-c", PROBE], env=probe_env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    lines = [line for line in probe.stdout.splitlines() if line.startswith("PROBE ")]
    record: dict[str, Any] = {"env": info, "block": block, "probe_returncode": probe.returncode}
    record["probe"] = json.loads(lines[-1][6:]) if lines else probe.stdout[-500:] + probe.stderr[-500:]
    if probe.returncode != 0 or (prefix and record["probe"].get("dns") == "resolved"):
        raise SystemExit(f"the network block does not block ({block}): {record['probe']}")
    make = ["make", "--no-print-directory", "gpu-check", f"PYTHON={info['python']}", f"OUT={out}"]
    make.append(f"GPU_CHECK_ARGS=--dry-run --work {work}")
    check_began = time.monotonic()
    with (out / "rehearsal.log").open("w") as log:
        done = subprocess.run([*prefix, *make], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    record |= {"command": " ".join(make), "returncode": done.returncode}
    record["check_seconds"] = round(time.monotonic() - check_began, 1)
    record["seconds"] = round(time.monotonic() - began, 1)
    report = out / "gpu_check.json"
    sections = json.loads(report.read_text())["sections"] if report.is_file() else {}
    record["sections"] = {name: f"{s['status']} in {s['seconds']} s" for name, s in sections.items()}
    (out / "rehearsal.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.rehearsal", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["env", "run"])
    p.add_argument("--out", type=Path, default=ROOT / "gpu_check_out" / "rehearsal")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: OUT/work)")
    args = p.parse_args(argv)
    if args.what == "env":
        print(json.dumps(build_env(), indent=1))
        return 0
    record = rehearse(args.out, args.work or args.out / "work")
    print(json.dumps(record, indent=1))
    return record["returncode"]


if __name__ == "__main__":
    sys.exit(main())
