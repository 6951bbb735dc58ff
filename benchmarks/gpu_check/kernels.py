"""Section 3: the fast kernels against their math twins (outputs and gradients, bf16 and fp32) and their speed.

- Ring attention's block kernel, ``ring.block_attention(q, k, v, causal, scale, kernel)`` -> ``(out, lse)``: each
  fused kernel for the device (``cuda_flash``, ``cuda_efficient``; ``cpu_flash`` in the dry run) against
  ``kernel="math"``, causal and not.
- MoE experts, ``moe.expert_forward(..., fused=True)`` (grouped GEMM) against ``fused=False``, on uneven loads;
  today's layer (``GroupedExperts``, a padded batched matmul) is timed beside them whatever the new API's state.

Both APIs are imported when the section runs; a name that is not there is reported as "not available". The two
``_call_*`` functions are the only places their signatures are written.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .kernel_timing import compare, forward_backward, time_ms

RING_KERNELS = {"cuda": ["cuda_flash", "cuda_efficient"], "cpu": ["cpu_flash"]}
BAR = {torch.float32: 1e-3, torch.bfloat16: 3e-2}  # largest difference / largest reference magnitude


def run(config: dict[str, Any]) -> dict[str, Any]:
    device = "cpu" if config["dry_run"] or not torch.cuda.is_available() else "cuda"
    dtypes = [torch.bfloat16, torch.float32]
    return {"device": device, "ring_attention": ring_attention(device, dtypes), "moe_experts": moe(device, dtypes)}


def _call_block_attention(ring: Any, kernel: str, q: Any, k: Any, v: Any, causal: bool, dout: Any = None) -> dict:
    """Forward (and with ``dout`` the explicit backward) of one block: ``ring.block_attention`` and
    ``ring.block_attention_backward`` (the merged output and log-sum-exp of a single block are its own)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = ring.block_attention(q, k, v, causal, scale, kernel=kernel)
    grads = [] if dout is None else list(ring.block_attention_backward(dout, q, k, v, out, lse, causal, scale, kernel))
    return {"outputs": [out, lse], "grads": grads}


def _call_expert_forward(fn: Any, fused: bool, experts: Any, rows: Any, counts: Any) -> Any:
    return fn(rows, counts, experts.w1, experts.w2, experts.w3, experts.activation, fused=fused)


def ring_attention(device: str, dtypes: list[torch.dtype]) -> dict[str, Any]:
    try:
        from lightning_parallel.parallel.context import ring

        ring.block_attention, ring.block_attention_backward  # noqa: B018  (both names, or "not available")
    except (ImportError, AttributeError) as err:
        return {"status": f"not available: {err}"}
    b, h, t, d = (2, 12, 2048, 64) if device == "cuda" else (1, 2, 64, 16)
    rows = []
    for dtype in dtypes:
        for causal in (True, False):
            q, k, v, dout = (torch.randn(b, h, t, d, device=device, dtype=dtype) for _ in range(4))
            label = {"dtype": _name(dtype), "causal": causal, "shape": [b, h, t, d]}
            flops = 4 * b * h * t * t * d / (2 if causal else 1)
            want = _call_block_attention(ring, "math", q, k, v, causal, dout)  # the twin every kernel is held to
            for kernel in ["math", *RING_KERNELS[device]]:
                try:
                    diffs = (
                        {}
                        if kernel == "math"
                        else compare(_call_block_attention(ring, kernel, q, k, v, causal, dout), want)
                    )
                except Exception as err:  # noqa: BLE001  (an unsupported dtype or kernel is a row)
                    rows.append(label | {"kernel": kernel, "status": f"{type(err).__name__}: {str(err)[:300]}"})
                    continue
                ok = all(x <= BAR[dtype] for x in diffs.values())
                timing = _timed_ring(ring, kernel, (q, k, v), causal, dout, flops)
                status = {"status": "ok" if ok else "MISMATCH", "bar": BAR[dtype]} if diffs else {}
                rows.append(label | {"kernel": kernel} | status | diffs | timing)
    return {"status": "ok", "rows": rows}


def _timed_ring(ring: Any, kernel: str, qkv: tuple, causal: bool, dout: Any, flops: float) -> dict[str, Any]:
    try:
        forward = time_ms(lambda: _call_block_attention(ring, kernel, *qkv, causal)["outputs"], backward=False)
        train = time_ms(lambda: _call_block_attention(ring, kernel, *qkv, causal, dout)["grads"], backward=False)
    except Exception as err:  # noqa: BLE001
        return {"timing": f"{type(err).__name__}: {str(err)[:200]}"}
    return {"forward_ms": forward, "train_ms": train, "forward_tflops": flops / (forward * 1e9)}


def moe(device: str, dtypes: list[torch.dtype]) -> dict[str, Any]:
    from lightning_parallel.parallel.expert.moe import GroupedExperts

    try:
        from lightning_parallel.parallel.expert.moe import expert_forward
    except ImportError as err:
        expert_forward, status = None, f"fused path not available: {err}"
    else:
        status = "ok"
    e, d, f, n = (8, 1024, 2816, 32768) if device == "cuda" else (4, 32, 64, 256)
    flops = 2 * 2 * n * d * f  # two matmuls of every row
    rows = []
    for dtype in dtypes:
        experts = GroupedExperts(e, d, f).to(device)
        experts.fused = False  # the padded batched matmul, the layer before grouped GEMM (None: by device)
        weights = torch.linspace(1.0, 3.0, e)  # uneven loads: the busiest expert gets 3x the idlest's rows
        counts = torch.bincount(torch.multinomial(weights, n, replacement=True), minlength=e).to(device)
        x = [torch.randn(n, d, device=device, dtype=dtype)]
        label = {"dtype": _name(dtype), "shape": [e, d, f, n]}

        def layer(_: Any, rows_: Any, experts: Any = experts, counts: Any = counts) -> Any:
            return (experts(rows_, counts),)

        rows.append(label | {"kernel": "GroupedExperts (padded bmm)"} | _timed(layer, None, x, flops))
        if expert_forward is None:
            continue

        def run(fused: bool, rows_: Any, experts: Any = experts, counts: Any = counts) -> Any:
            return (_call_expert_forward(expert_forward, fused, experts, rows_, counts),)

        try:
            want = forward_backward(run, False, x, list(experts.parameters()))
        except Exception as err:  # noqa: BLE001  (the signature is not final: say so and go on)
            rows.append(label | {"kernel": "fused=False", "status": f"{type(err).__name__}: {str(err)[:300]}"})
            continue
        rows.append(label | {"kernel": "fused=False"} | _timed(run, False, x, flops))
        rows.append(label | {"kernel": "fused=True"} | _checked(run, True, x, want, dtype, flops, experts))
    return {"status": status, "rows": rows}


def _checked(fn: Any, choice: Any, inputs: list, want: dict, dtype: torch.dtype, flops: float, module: Any = None):
    """Differences from the math twin, then speed; an unsupported dtype or kernel is a row, not the section's end."""
    params = list(module.parameters()) if module is not None else []
    try:
        diffs = compare(forward_backward(fn, choice, inputs, params), want)
    except Exception as err:  # noqa: BLE001
        return {"status": f"{type(err).__name__}: {str(err)[:300]}"}
    ok = all(v <= BAR[dtype] for v in diffs.values())
    return {"status": "ok" if ok else "MISMATCH", "bar": BAR[dtype], **diffs} | _timed(fn, choice, inputs, flops)


def _timed(fn: Any, choice: Any, inputs: list, flops: float) -> dict[str, Any]:
    """Forward, and forward + backward, milliseconds (CUDA events on a GPU) and the forward's TFLOP/s."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    try:
        forward = time_ms(lambda: fn(choice, *leaves), backward=False)
        train = time_ms(lambda: fn(choice, *leaves))
    except Exception as err:  # noqa: BLE001
        return {"timing": f"{type(err).__name__}: {str(err)[:200]}"}
    return {"forward_ms": forward, "train_ms": train, "forward_tflops": flops / (forward * 1e9)}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]
