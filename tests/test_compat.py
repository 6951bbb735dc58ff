"""Every private torch and Lightning API the package uses resolves on the installed versions (lightning_parallel/
_compat.py is where they are listed), and the package's layering holds: no import circles, parallel/ free of
Lightning, no module past the size the house style allows."""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_parallel import _compat

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_parallel"
MAX_LINES = 400


def test_private_apis_resolve():
    for name in _compat.lightning_entries():
        assert callable(getattr(_compat, name)), name
    assert hasattr(PipelineStage, _compat.PIPELINE_STAGE_SHAPE_CLEANUP)
    hooked = _compat.ShapeInferenceHookStage.__dict__  # the stage overrides the hook this torch calls
    assert _compat.PIPELINE_STAGE_SHAPE_CLEANUP in hooked
    for name in _compat.PIPELINE_WARMUP_VOTE:  # the simulator's stages answer torch's warm-up vote
        assert hasattr(PipelineStage, name) and name in _compat.StaticVoteStage.__dict__
    # import lightning_parallel patches nothing of Lightning's (its one side effect: the strategy registries)
    assert _AcceleratorConnector._check_and_init_precision.__module__ == _AcceleratorConnector.__module__
    assert "_local_tensor" in torch.distributed.tensor.DTensor.__slots__  # set_local_tensor/local_tensor alias it
    assert callable(_compat.compute_local_shape_and_global_offset) and callable(_compat.set_element)
    assert callable(_compat.FsspecWriter.prepare_local_plan) and callable(_compat.FsspecReader.read_metadata)
    assert callable(_compat.disable_current_modes) and callable(_compat.tree_map)
    assert not _compat.is_in_torch_dispatch_mode(include_infra_modes=False)
    assert callable(torch._C._current_graph_task_id) and not _compat.in_backward()
    with _compat.fake_tensor_mode():  # the simulator: shapes without memory, torch's memory tracker over them
        assert type(torch.empty(2)).__name__ == "FakeTensor" and _compat.is_fake_tensor(torch.empty(2))
    assert not _compat.is_fake_tensor(torch.empty(2))
    assert callable(_compat.mem_tracker().get_tracker_snapshot) and callable(_compat.resolve_group)
    table, ops = _compat.float8_gather_ops()  # torchao's float8 all-gather entries (parallel/float8.py)
    assert all(callable(table[op]) for op in ops)
    grouped = inspect.signature(_compat.float8_grouped_mm())  # the experts' float8 grouped GEMM (float8_experts.py)
    assert (
        list(grouped.parameters)[:3] == ["A", "B_t", "offs"] and "pad_token_groups_for_grouped_mm" in grouped.parameters
    )
    from torch.distributed._tools.mem_tracker import MemTracker  # the frozen parameters' hooks are skipped there

    assert callable(MemTracker._track_module_params_and_buffers)
    assert "_param_to_grad_hook_handles" in vars(_compat.mem_tracker())
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(DeviceMesh._flatten)
    world = torch.distributed.group.WORLD  # group_size_of / group_name_of resolve a group by its name
    assert world is None or _compat.group_name_of(world) == world.group_name
    from torch.distributed import distributed_c10d as c10d

    for name in ("_resolve_process_group", "_get_default_store", "_device_capability", "_set_pg_timeout"):
        assert callable(getattr(c10d, name)), name
    import torch.distributed._functional_collectives as funcol

    # strict mode (parallel/strict/): the world group, a functional collective's group by name, and the functions
    # it wraps in torch.distributed's own module (batch_isend_irecv and P2POp look them up there)
    assert callable(c10d._get_default_group) and callable(funcol._resolve_group_name)
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv"):
        assert callable(getattr(c10d, name)), name
    assert callable(c10d._abort_process_group)
    assert isinstance(c10d._world.pg_map, dict) and _compat.process_groups() == list(c10d._world.pg_map)
    assert callable(c10d._get_default_timeout)  # tests/workers/cases/group_timeouts.py gives gloo NCCL's default
    assert isinstance(c10d._world.pg_names, dict)  # group_sequence_numbers and flight_recorder_dump (heartbeat.py)
    assert callable(c10d.ProcessGroup._get_sequence_number_for_group)
    assert callable(torch._C._distributed_c10d._dump_fr_trace) and callable(
        torch._C._distributed_c10d._dump_fr_trace_json
    )
    import torch.distributed.pipelining.schedules as schedules  # measure/timeline.py wraps it while recording

    assert callable(schedules._wait_batch_p2p)
    assert isinstance(_compat.StridedShard(0, split_factor=2), torch.distributed.tensor.placement_types.Placement)
    if hasattr(dist, "all_gather_single"):  # torch 2.13: its own names, not the deprecated ones 2.11 has
        calls = []
        with (
            mock.patch.object(dist, "all_gather_single", lambda *a, **k: calls.append("ag")),
            mock.patch.object(dist, "reduce_scatter_single", lambda *a, **k: calls.append("rs")),
        ):
            _compat.all_gather_single(None, None)
            _compat.reduce_scatter_single(None, None)
        assert calls == ["ag", "rs"]


def test_version_shims_at_world_1():
    """The pipeline stage hook runs once per schedule, after shape inference, with the RNG as it was before the step
    (torch 2.13 forks it around metadata inference; on 2.11 the shim does); the flat collectives run."""
    from harness import free_port
    from torch.distributed.pipelining import ScheduleGPipe

    seen = []

    class Stage(_compat.ShapeInferenceHookStage):
        def after_shape_inference(self) -> None:
            seen.append(torch.get_rng_state())

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
        schedule = ScheduleGPipe(Stage(module, 0, 1, torch.device("cpu")), 2, loss_fn=lambda out, y: out.sum())
        before = torch.get_rng_state()
        schedule.step(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), target=torch.zeros(4))
        assert len(seen) == 1 and torch.equal(seen[0], before)
        flat = torch.zeros(3)  # the flat collectives, whichever name this torch gives them
        _compat.all_gather_single(flat, torch.arange(3.0))
        out = torch.zeros(3)
        _compat.reduce_scatter_single(out, flat)
        assert out.tolist() == [0.0, 1.0, 2.0]
        (name,) = _compat.group_sequence_numbers()  # torch's own count of what this process issued on the group
        issued = _compat.group_sequence_numbers()[name][0]
        dist.all_reduce(flat)
        assert _compat.group_sequence_numbers() == {name: (issued + 1, (0,))}
        assert "pg_status" in json.loads(_compat.flight_recorder_dump(as_json=True))
    finally:
        dist.destroy_process_group()


def _imports(path: Path, modules: set[str] | None = None) -> set[str]:
    """lightning_parallel modules ``path`` imports, at module level and inside functions alike (an import run late
    still makes a circle), but not under ``if TYPE_CHECKING:`` (never run). ``from pkg import sub`` counts as
    importing ``sub`` when it is a module (the package's own initialization is not an edge)."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_parallel"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            named = {m for m in subs if modules is not None and m in modules}
            found |= named if named == subs else named | {node.module}
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_parallel"))
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING"
            ):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    names = set(modules)
    return {name: {m for m in _imports(path, names) if m in names and m != name} for name, path in modules.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (node -> the nodes it imports), or None."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            found = [*trail, node, nxt] if state.get(nxt) == 1 else None if nxt in state else visit(nxt, [*trail, node])
            if found:
                return found
        state[node] = 2
        return None

    return next((c for node in list(graph) if node not in state and (c := visit(node, []))), None)


def test_no_import_circle():
    circle = _circle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_no_import_circle_between_packages():
    """At every level too: each module counted as its package (or top module) at that depth, the packages'
    imports of one another make no circle (a package importing its own subpackages, or they it, is no edge)."""
    modules = _graph()
    for depth in range(1, max(m.count(".") for m in modules) + 1):
        graph: dict[str, set[str]] = {}
        for module, deps in modules.items():
            a = ".".join(module.split(".")[: depth + 1])
            for b in {".".join(d.split(".")[: depth + 1]) for d in deps}:
                if not (a == b or b.startswith(f"{a}.") or a.startswith(f"{b}.")):
                    graph.setdefault(a, set()).add(b)
        circle = _circle(graph)
        assert circle is None, f"import circle between packages (depth {depth}): " + " -> ".join(circle or [])


def test_parallel_imports_no_lightning_and_nothing_above_it():
    for path in (PACKAGE / "parallel").rglob("*.py"):
        text = path.read_text()
        # Lightning's packages (lightning, lightning.pytorch, ...), not lightning_parallel's own modules
        assert not re.search(r"^\s*(import|from) lightning(\.|\s|$)", text, re.MULTILINE), path
        for module in _imports(path):
            allowed = module.startswith(("lightning_parallel.parallel", "lightning_parallel._compat"))
            allowed |= module.startswith("lightning_parallel.protocol")
            assert allowed, f"{path.relative_to(PACKAGE)} imports {module}"


# The package's layers, lowest first: a module imports from its own layer or below, never above (the model adapters
# no strategy, the strategies no Fabric glue or recipe). "" is the package's own __init__ (its public names).
LAYERS = {
    "_compat": 0,
    "protocol": 0,
    "parallel": 1,
    **dict.fromkeys(
        ("causal_lm", "models", "hf", "litgpt", "text", "preference", "planning", "plugins", "callbacks"), 2
    ),
    "strategies": 3,
    "fabric": 4,
    **dict.fromkeys(("", "checkpoint", "plan", "recipes", "simulate"), 5),
}


def test_no_upward_import():
    def layer(module: str) -> int:
        top = module.split(".")[1] if "." in module else ""
        assert top in LAYERS, f"{module}: put lightning_parallel.{top} in a layer of LAYERS"
        return LAYERS[top]

    upward = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps if layer(d) > layer(m)]
    assert not upward, f"imports from a higher layer: {upward}"


def test_modules_stay_small():
    sizes = {p.relative_to(PACKAGE): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    big = {str(p): n for p, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_every_package_says_what_it_owns():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(PACKAGE)} has no docstring"
