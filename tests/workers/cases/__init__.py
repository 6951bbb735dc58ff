"""The case modules of tests/workers/run.py: each ``run_case(case: dict, ctx: run.Context) -> dict`` does one case
on one rank (``PROCESS_GROUP = True``: run.py makes the gloo world group; ``setup()``: once per process)."""
