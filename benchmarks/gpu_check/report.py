"""``gpu_check.json`` and ``gpu_check.md``, rewritten after every section (a check stopped half-way still leaves
what it measured), and ``gpu_check.log`` with every section's own output."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class Report:
    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.log_file = out, out / "gpu_check.log"
        self.log_file.write_text("")
        self.data: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "dry_run": dry_run,
            "budget_s": budget_s,
            "setup": None,  # deps.py: what was missing, installed from .whl/, and still missing (with why)
            "sections": {},
        }
        self._write()

    def set_setup(self, setup: dict[str, Any]) -> None:
        self.data["setup"] = setup
        self._write()

    def add(self, name: str, entry: dict[str, Any]) -> None:
        self.data["sections"][name] = entry
        self._write()

    def counts(self) -> str:
        statuses = [s["status"] for s in self.data["sections"].values()]
        return ", ".join(f"{statuses.count(k)} {k}" for k in ("ok", "skipped", "failed", "timeout") if k in statuses)

    def _write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# gpu-check{' (dry run, CPU)' if data['dry_run'] else ''}", ""]
    lines += [f"Started {data['started']}, budget {data['budget_s']:.0f} s.", ""]
    setup = data.get("setup") or {}
    if setup.get("installed"):
        lines += [f"Installed from .whl/ (offline): {', '.join(sorted(setup['installed']))}.", ""]
    lines += [f"- missing: {name}: {why}" for name, why in (setup.get("still_missing") or {}).items()]
    lines += ["| section | status | seconds | limit |", "|---|---|---|---|"]
    for name, s in data["sections"].items():
        lines.append(f"| {name} | {s['status']} | {s['seconds']} | {s['limit_s']} |")
    lines += _mfu_table(data["sections"])
    for name, s in data["sections"].items():
        lines += ["", f"## {name}", ""]
        if s["status"] != "ok":
            lines += ["```", str(s.get("error", ""))[-3000:], "```"]
            continue
        render = RENDER.get(name.split("_")[0], _generic)
        lines += render(s["result"])
    return "\n".join(lines) + "\n"


def _generic(result: dict[str, Any]) -> list[str]:
    return [f"- {k}: {_fmt(v)}" for k, v in result.items()]


def _tier(result: dict[str, Any]) -> list[str]:
    lines = [f"`{result['command']}`: {result['counts']}, exit {result['returncode']}"]
    lines += ["(stopped at the section's limit)" if result["timed_out"] else "", "| test | outcome | s | figures |"]
    lines.append("|---|---|---|---|")
    skipped: dict[str, int] = {}
    for t in result["tests"]:
        if t["outcome"] == "skipped":
            skipped[t.get("message", "")] = skipped.get(t.get("message", ""), 0) + 1
            continue
        figures = "<br>".join(t.get("figures") or []) or t.get("message", "")[:200].replace("\n", " ")
        lines.append(f"| {t['name']} | {t['outcome']} | {t.get('seconds', '')} | {figures.replace('|', '/')} |")
    lines += [""] + [f"- skipped {n}: {reason}" for reason, n in skipped.items()]
    return lines + (["", "```", result["output_tail"], "```"] if result.get("output_tail") else [])


def _kernels(result: dict[str, Any]) -> list[str]:
    lines = []
    for name in ("ring_attention", "moe_experts"):
        part = result[name]
        lines += [f"### {name}: {part['status']}", ""]
        rows = part.get("rows", [])
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
        lines.append("")
    return lines


def _mfu(result: dict[str, Any]) -> list[str]:
    flops = result["flops_per_step"]
    return [
        f"{result['variant']}: {_fmt(result['tokens_per_second'])} tokens/s, MFU {_fmt(result['mfu'])}, "
        f"step {_fmt(result['step_seconds'])} s, peak memory {_fmt(result['peak_memory_bytes'])} B",
        f"- model {result['model']}, micro batch {result['micro_batch']}, {result['precision']}, compiled "
        f"{result['compiled']}, {result['timed_steps']} timed steps after {_fmt(result['warmup_seconds'])} s warm-up",
        f"- FLOPs per step {flops['counted']:.3e} (counted), {flops['rule_of_thumb']:.3e} (6NT + 12LT^2d); "
        f"device peak {_fmt(result['peak_flops'])}",
        f"- losses {[round(v, 4) for v in result['losses']]}",
    ]


def _mfu_table(sections: dict[str, Any]) -> list[str]:
    """The three MFU runs side by side (same model, batch and precision), against the plain loop."""
    runs = {n: s["result"] for n, s in sections.items() if n.startswith("mfu_") and s["status"] == "ok"}
    if not runs:
        return []
    base = runs.get("mfu_plain", {}).get("tokens_per_second")
    lines = ["", "| run | tokens/s | MFU | vs plain loop | step ms | peak memory GB |", "|---|---|---|---|---|---|"]
    for r in runs.values():
        tps, step, peak = r["tokens_per_second"], r["step_seconds"], r["peak_memory_bytes"]
        ratio = tps / base if tps and base else None
        cells = [r["variant"], _fmt(tps), _fmt(r["mfu"]), _fmt(ratio), _fmt(step * 1e3 if step else None)]
        lines.append("| " + " | ".join(cells + [_fmt(peak / 1e9 if peak else None)]) + " |")
    return lines


RENDER = {"gpu": _tier, "kernels": _kernels, "mfu": _mfu}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)
