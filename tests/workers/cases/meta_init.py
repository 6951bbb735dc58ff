"""Case ``meta_init``: sets a model up under one strategy (no training step) and measures what each rank held on
the way.

Run by tests/test_meta_init.py through tests/harness.py. Each case builds a model one way (``build``: ``host`` in
``__init__``, ``configure`` in ``configure_model``, ``init_module`` under ``Trainer.init_module()``), runs
``trainer.fit`` with ``max_steps=0`` (the strategy's whole setup: split, materialization, optimizers) and records:

- ``peak_tensor_bytes``: the most bytes of tensor storage alive at once on this rank from before the model is built
  to the end of setup, counted op by op by a dispatch mode (:class:`PeakTensorBytes`; exact, and the same on any
  device and allocator);
- ``rss_growth``: the process's peak resident memory over the same window minus its resident memory at its start
  (the kernel's high-water mark, reset per case through ``/proc/self/clear_refs``; glibc is told to return large
  blocks at once, so freed memory shows), a check that nothing outside the dispatcher held a copy;
- ``model_bytes``: the whole model's parameter bytes; with ``save``, the full state dict after setup (rank 0).

Case keys: name, strategy (a registered name or ``hybrid3d:tp=2,...``), build, model (``gpt``; ``plain``: an
MLP whose modules keep torch's default init, drawn from the global generator; ``hf`` or ``litgpt``: HFCausalLM or
LitGPTCausalLM of a config alone, which build themselves on meta: ``build`` does not apply), gpt (GPTConfig
overrides), hf (a transformers config's fields), litgpt (a litgpt config name and overrides), save. With ``hf`` or
``litgpt`` the result has ``layer_bytes``, the largest pipeline layer's parameter bytes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_parallel._compat import TorchDispatchMode, tree_leaves
from lightning_parallel.models import GPTConfig, GPTModule
from lightning_parallel.models.gpt import RecipeGPT
from lightning_parallel.parallel.dtensor import local

from .common import build_strategy


class PeakTensorBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once while active: every op's outputs are noted (weakly) with
    their size, and after each op the storages freed since are dropped and the total compared with the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ref in [ref for ref in self.live if ref.expired()]:
            self.current -= self.live.pop(ref)
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._note(local(t))
        self.peak = max(self.peak, self.current)
        return out

    def _note(self, t: Tensor) -> None:
        if t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
            storage.data_ptr()
        except RuntimeError:  # a wrapper subclass without storage of its own
            return
        ref = StorageWeakRef(storage)
        if ref not in self.live:
            self.live[ref] = storage.nbytes()
            self.current += storage.nbytes()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def setup() -> None:  # once per process, before the first case
    """glibc: blocks of 64 KiB and more are mmapped and unmapped on free (no dynamic threshold), heap tops trimmed."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD


class PlainMLP(pl.LightningModule):
    """An ordinary model: torch's default init (the global generator), no reset_parameters of its own."""

    def __init__(self, build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.net = None if build_in_configure_model else self.build()

    @staticmethod
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self.build()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def tensor_parallel_plan(self, sequence_parallel: bool = False):
        return {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}

    def training_step(self, batch, batch_idx):
        return self(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class EndOfSetup(pl.Callback):
    """Stops the measurement when the strategy's setup is done (the fit has not started)."""

    def __init__(self, meter: PeakTensorBytes) -> None:
        self.meter = meter
        self.peak = self.local_bytes = None
        self.built_on = None

    def on_fit_start(self, trainer, pl_module):
        self.peak = self.meter.peak
        self.rss_peak_kib = _status_kib("VmHWM")
        params = list(dict.fromkeys(trainer.strategy.model.parameters()))
        self.local_bytes = sum(local(p).untyped_storage().nbytes() for p in params)


def config_only(case: dict) -> pl.LightningModule:
    """``model: hf`` (case key ``hf``: a transformers config's fields, model_type among them) or ``model: litgpt``
    (case key ``litgpt``: a litgpt config name and overrides): the module of a config alone, built on meta by itself."""
    if case["model"] == "hf":
        from transformers import AutoConfig

        from lightning_parallel.hf import HFCausalLM

        fields = dict(case["hf"])
        return HFCausalLM(AutoConfig.for_model(fields.pop("model_type"), **fields))
    from lightning_parallel.litgpt import LitGPTCausalLM

    fields = dict(case["litgpt"])
    return LitGPTCausalLM(fields.pop("name"), **fields)


def _model(case: dict, build_here: bool) -> pl.LightningModule:
    if case.get("model") in ("hf", "litgpt"):
        return config_only(case)
    if case.get("model") == "plain":
        return PlainMLP(build_in_configure_model=not build_here)
    return GPTModule(GPTConfig(**case.get("gpt", {})), build_in_configure_model=not build_here)


def _layer_bytes(module: pl.LightningModule) -> int:
    """The parameter bytes of the largest pipeline layer (embedding, block, norm or head): "one layer"."""
    return max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in module.pipeline_layers())


def run_case(case: dict, ctx) -> dict:
    world, out = ctx.world, ctx.out
    pl.seed_everything(0, verbose=False)
    config = GPTConfig(**case.get("gpt", {}))
    layer_bytes = None
    if case.get("model") in ("hf", "litgpt"):
        whole = config_only(case)  # on meta: no memory, no draws
        layer_bytes = _layer_bytes(whole)
    else:
        with torch.device("meta"):  # no draws from the global generator
            whole = PlainMLP.build() if case.get("model") == "plain" else RecipeGPT(config)
    model_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    del whole
    build = case.get("build", "configure")
    meter = PeakTensorBytes()
    probe = EndOfSetup(meter)
    reset = _reset_rss_peak()
    rss_start = _status_kib("VmRSS")
    with meter:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=build_strategy(case["strategy"]),
            max_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[probe],
        )
        if build == "init_module":
            with trainer.init_module():
                model = _model(case, build_here=True)
        else:
            model = _model(case, build_here=build == "host")
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 16)), batch_size=2)
        trainer.fit(model, train_dataloaders=loader)
    result = {
        "name": case["name"],
        "model_bytes": model_bytes,
        "layer_bytes": layer_bytes,
        "peak_tensor_bytes": probe.peak,
        "local_param_bytes": probe.local_bytes,
        "rss_growth": (probe.rss_peak_kib - rss_start) * 1024 if reset else None,
    }
    if case.get("save"):
        state = trainer.strategy.full_state_dict()
        if trainer.global_rank == 0:
            torch.save(state, out / f"{case['name']}_params.pt")
    return result
