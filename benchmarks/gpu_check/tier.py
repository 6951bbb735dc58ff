"""Section 2: the gpu test tier (``pytest -m gpu``, tests/gpu/), pass or fail per test.

pytest runs with ``-v`` into a file and a JUnit XML: the XML gives each test's outcome, time, message and printed
figures; if pytest had to be stopped at the section's limit, the ``-v`` lines give what had finished.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

STOP_EARLY_S = 10.0  # pytest is stopped this long before the section's limit, so its result is still written
_VERBOSE = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def run(config: dict[str, Any]) -> dict[str, Any]:
    work, root = Path(config["work"]), Path(config["root"])
    xml, output = work / "tier.xml", work / "tier.out"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={xml}", "-o", "junit_logging=system-out"]
    timeout = config["deadline"] - time.monotonic() - STOP_EARLY_S
    with output.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode, timed_out = proc.wait(timeout=max(1.0, timeout)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and every rank it started
            returncode, timed_out = proc.wait(), True
    text = output.read_text(errors="replace")
    tests = parse_junit(xml) if xml.is_file() else parse_verbose(text)
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {
        "command": " ".join(cmd[1:]),
        "returncode": returncode,
        "timed_out": timed_out,
        "counts": counts,
        "tests": tests,
        "summary_line": next((line for line in reversed(text.splitlines()) if line.startswith("=")), ""),
        "output_tail": text[-4000:] if returncode != 0 else "",  # a collection error, a crash, a hang's last words
    }


def parse_junit(xml: Path) -> list[dict[str, Any]]:
    """Each testcase: ``name``, ``outcome`` (passed, failed, error, skipped), ``seconds``, ``message`` (the first
    lines of a failure or the skip reason) and ``figures`` (printed lines that report a measured difference)."""
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or node.text or "")[:800]
                break
        out = case.findtext("system-out") or ""
        tests.append(
            {
                "name": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                "outcome": outcome,
                "seconds": round(float(case.get("time") or 0.0), 2),
                "message": message,
                "figures": [line for line in out.splitlines() if "diff" in line][:12],
            }
        )
    return tests


def parse_verbose(text: str) -> list[dict[str, Any]]:
    """Outcomes from ``pytest -v`` lines (when pytest was stopped before writing its XML)."""
    tests = []
    for line in text.splitlines():
        match = _VERBOSE.match(line)
        if match:
            tests.append({"name": match.group(1).split("/")[-1], "outcome": match.group(2).lower(), "message": ""})
    return tests
