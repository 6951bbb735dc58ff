"""The tutorials (docs/tutorials/) run as written: each page's shell blocks, in order, as one bash script in one
scratch folder that sees the repository's recipes and configs, as a reader who copies them into one terminal.

Two marks on the line before a block change what runs (tests/test_docs.py parses every block, and skips these
pages when it runs snippets):

- ``<!-- docs: tiny KEY=VALUE ... -->``: the smaller sizes this machine can run, given to each recipe command of
  the block (replacing the same keys, else added after the command's own); nothing else is changed.
- ``<!-- docs: no-run slurm -->``: the block runs with a stand-in ``sbatch`` (and ``srun``) first on the PATH, which
  keeps the batch script it is given as ``sbatch_script.sh`` and refuses the submission, so the command fails.

After each page, its checks read what the commands left (metrics, samples, the summary, the batch script).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_docs import LINKED, RECIPE, ROOT

TUTORIALS = ROOT / "docs" / "tutorials"
TINY = re.compile(r"<!-- docs: tiny (.+?) -->")
NO_RUN = re.compile(r"<!-- docs: no-run (\S+) -->")
FENCE = re.compile(r"^```(\w*)")
# the stand-in for SLURM's commands (PATH is searched first in bin/): keeps the script, refuses to submit
STAND_IN = (
    '#!/bin/sh\n[ "$(basename "$0")" = sbatch ] && cp "$1" sbatch_script.sh\necho "no SLURM cluster here" >&2\nexit 1\n'
)
# where a recipe command's arguments end: a redirection, a pipe, a list operator, a background job
ARGS_END = re.compile(r"\s(?:\d?>|\|\|?|&&|&|;)")


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """The page's bash blocks: (code, tiny overrides, no-run reason)."""
    lines, found = page.read_text().splitlines(), []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[i - 1] if i else ""
        if match.group(1) == "bash":
            tiny, no_run = TINY.search(before), NO_RUN.search(before)
            code = "\n".join(lines[i + 1 : end])
            found.append((code, tiny.group(1) if tiny else "", no_run.group(1) if no_run else None))
        i = end + 1
    return found


def with_tiny(command: str, tiny: str) -> str:
    """A recipe command with the ``tiny`` overrides: the same keys replaced, the others added after its own."""
    for item in tiny.split():
        key = re.escape(item.split("=", 1)[0])
        replaced, n = re.subn(rf"(?<=\s){key}=\S+", item, command)
        if n:
            command = replaced
            continue
        end = ARGS_END.search(command)
        at = end.start() if end else len(command)
        command = f"{command[:at]} {item}{command[at:]}"
    return command


def script(page: Path) -> str:
    """The page as one bash script (continuation lines joined where a recipe command gets tiny overrides)."""
    parts = ["set -euo pipefail"]
    for code, tiny, no_run in blocks(page):
        if no_run not in (None, "slurm"):
            continue
        if tiny:
            joined = code.replace("\\\n", " ")
            code = "\n".join(with_tiny(line, tiny) if RECIPE.search(line) else line for line in joined.splitlines())
        if no_run == "slurm":
            code = f'if PATH="$PWD/bin:$PATH" bash -c {_quote(code)}; then exit 1; fi  # the stand-in refuses it'
        parts.append(code)
    return "\n".join(parts) + "\n"


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def run_page(name: str, tmp_path: Path) -> subprocess.CompletedProcess:
    for linked in LINKED:
        if (ROOT / linked).exists():
            (tmp_path / linked).symlink_to(ROOT / linked)
    (tmp_path / "bin").mkdir()
    for command in ("sbatch", "srun"):
        (tmp_path / "bin" / command).write_text(STAND_IN)
        (tmp_path / "bin" / command).chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "-c", script(TUTORIALS / name)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3000
    )
    assert done.returncode == 0, f"{name}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def test_every_tutorial_is_in_the_nav_and_has_checks():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in TUTORIALS.glob("*.md"))
    assert pages == sorted(CHECKS), pages
    assert all(f"tutorials/{p}" in nav for p in pages)


def test_tiny_overrides_replace_or_follow_the_command_s_own():
    command = "python recipes/train_gpt.py -m model=gpt_small trainer.max_steps=50 x=1 || echo failed"
    got = with_tiny(command, "model=gpt_tiny trainer=debug")
    assert got == "python recipes/train_gpt.py -m model=gpt_tiny trainer.max_steps=50 x=1 trainer=debug || echo failed"
    assert (
        with_tiny("python recipes/finetune.py a=1 > log 2>&1 &", "b=2")
        == "python recipes/finetune.py a=1 b=2 > log 2>&1 &"
    )


def check_finetune(cwd: Path, out: str) -> None:
    metrics = json.loads((cwd / "runs/finetune/metrics.json").read_text())
    assert metrics["steps"] == 100 and metrics["layout"]["tp"] == 2 and metrics["trainable_params"] > 0
    samples = json.loads((cwd / "runs/finetune/samples.json").read_text())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (cwd / "adapter").iterdir()}
    assert not (cwd / "base-llama" / "chat_template.jinja").exists()  # the template came from data.chat_template
    # peft's generation from the exported adapter gives the recipe's own answer
    assert f"answer: {samples[0]['after'].strip()}" in out, (out[-2000:], samples[0])


def check_pretrain(cwd: Path, out: str) -> None:
    printed = re.search(r"recipe: (.+)", out).group(1).split()  # the planner's first proposal
    page = (TUTORIALS / "pretrain-70b-slurm.md").read_text()
    assert f"recipe: {' '.join(printed)}" in page, printed  # the page shows what the planner prints
    slurm = next(code for code, _, no_run in blocks(TUTORIALS / "pretrain-70b-slurm.md") if no_run == "slurm")
    assert all(item in slurm.split() for item in printed), "the submission carries every printed override"
    metrics = json.loads((cwd / "runs/rehearsal/metrics.json").read_text())
    layout = metrics["layout"]
    assert (layout["pp"], layout["cp"], layout["zero_stage"], metrics["steps"]) == (2, 2, 3, 4), layout
    written = (cwd / "sbatch_script.sh").read_text()
    (sweep,) = set(re.findall(r"(/[^\s=]*?/multirun/[\d-]+/[\d-]+)/", written))
    python = re.search(r" (\S+python\S*) -u -m submitit", written).group(1)
    shown = page.split("```text\n#!/bin/bash", 1)[1].split("```", 1)[0]
    assert written.replace(sweep, "SWEEP").replace(python, "PYTHON").strip() == f"#!/bin/bash{shown}".strip()


def check_sweep(cwd: Path, out: str) -> None:
    assert "the sweep exited with status 1: a job failed" in out
    summary = (cwd / "sweeps/degrees/summary.md").read_text()
    rows = [line for line in summary.splitlines() if "strategy.pp=" in line]
    assert len(rows) == 4 and sum("| ok |" in r for r in rows) == 3, summary
    (failed,) = [r for r in rows if "| failed |" in r]
    assert "strategy.pp=2" in failed and "strategy.tp=2" in failed and "Error in the config" in failed
    assert (cwd / "sweeps/degrees/summary.png").stat().st_size > 0
    assert len(re.findall(r"^(?:ok|failed) +dp=", out, re.M)) == 4  # the comparison printed every job


def check_recover(cwd: Path, out: str) -> None:
    assert out.count("steps: 100") == 2, out[-2000:]
    assert "Restart 1 of max_restarts=2" in out and "killed by SIGKILL" in (cwd / "own.log").read_text()
    torchrun = (cwd / "torchrun.log").read_text()
    assert "(exitcode: -9)" in torchrun, torchrun[-3000:]
    assert "#SBATCH --nodes=2" in (cwd / "sbatch_script.sh").read_text()


CHECKS = {
    "finetune-lora-tp.md": check_finetune,
    "pretrain-70b-slurm.md": check_pretrain,
    "sweep-degrees.md": check_sweep,
    "recover-killed-rank.md": check_recover,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_tutorial_runs_as_written(name, tmp_path):
    done = run_page(name, tmp_path)
    CHECKS[name](tmp_path, done.stdout)
