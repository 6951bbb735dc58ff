"""hybrid3d: every (pp, dp, tp) split trains exactly like one process on the same global batch."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from conftest import PARITY_CASES, Batch, deep, launch
from parity import assert_same_losses, assert_same_params

from lightning_parallel.parallel.pipeline.schedules import schedule_spec


class Layout(NamedTuple):
    world: int
    pp: int
    dp: int
    tp: int
    zero: int = 0
    schedule: str = "1f1b"
    sp: bool = False
    microbatches: int | None = None
    balance: str = "uniform"

    @property
    def spec(self) -> str:
        parts = [f"dp={self.dp}", f"pp={self.pp}", f"tp={self.tp}", f"zero_stage={self.zero}"]
        if self.pp > 1:
            parts.append(f"pp_schedule={self.schedule}")
        if self.microbatches:
            parts.append(f"microbatches={self.microbatches}")
        if self.balance != "uniform":
            parts.append(f"pp_balance={self.balance}")
        if self.sp:
            parts.append("sequence_parallel=1")
        return "hybrid3d:" + ",".join(parts)

    @property
    def deep(self) -> bool:
        """More stages than the 2-block GPT's 4 layers: use the 6-block one (8 layers)."""
        per_rank = schedule_spec(self.schedule).fixed_stages or 2 if self.pp > 1 else 1
        return self.pp * per_rank > 4

    @property
    def id(self) -> str:
        name = f"w{self.world}-pp{self.pp}-dp{self.dp}-tp{self.tp}-zero{self.zero}"
        name += f"-{self.schedule}" if self.pp > 1 else ""
        name += f"-{self.balance}" if self.balance != "uniform" else ""
        return name + ("-sp" if self.sp else "")


def check_against_reference(run, reference, layout: Layout, cases: list[dict] = PARITY_CASES) -> None:
    """Losses, parameters and validation loss equal the single-process run's; every rank agrees."""
    world, tp, label = layout.world, layout.tp, layout.id
    dp_leaders = [d * tp for d in range(layout.dp)]  # one rank per dp index, on the first pipeline stage
    for case in cases:
        name = case["name"]
        for rank in range(world):  # every pp and tp rank of a dp index reports the same loss
            leader = rank % (layout.dp * tp) - rank % tp
            assert run.case(name, rank)["losses"] == run.case(name, leader)["losses"], f"{label} rank {rank}"
        loss_rel = assert_same_losses(run.losses(name, dp_leaders), reference.losses(name), f"{label} {name}")
        param_abs = assert_same_params(run.params(name), reference.params(name), f"{label} {name}")
        print(f"{label} {name}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")
    want_val = reference.case("plain")["val_loss"]
    want_samples = reference.case("plain")["val_samples"]
    for rank in range(world):
        got_val = run.case("plain", rank)["val_loss"]
        assert abs(got_val - want_val) <= 1e-5 * want_val, f"{label} rank {rank} val_loss {got_val} != {want_val}"
        # a torchmetrics metric syncs over dp only: pp and tp ranks share their dp index's samples
        assert run.case("plain", rank)["val_samples"] == want_samples, f"{label} rank {rank} metric sync"


LAYOUTS = [  # `make test`: dp x tp without pipeline, then every schedule with dp, tp and ZeRO beside it
    Layout(2, 1, 1, 2),
    Layout(4, 1, 2, 2, zero=3),
    Layout(2, 2, 1, 1, schedule="1f1b"),
    Layout(4, 2, 1, 2, schedule="1f1b", microbatches=2),  # clipping and accumulation under pp=2, tp=2
    Layout(4, 2, 2, 1, zero=1, schedule="gpipe"),
    Layout(4, 2, 2, 1, zero=3, schedule="interleaved_1f1b"),
    Layout(4, 2, 1, 2, zero=1, schedule="zero_bubble", sp=True, microbatches=2),
]

_SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"]


def _world8() -> list[Layout]:
    """Every (pp, dp, tp) split of 8 ranks with zero 0 and 1 (3 for some), schedules taken in turn."""
    layouts = []
    turn = 0
    for pp in (1, 2, 4, 8):
        for dp in (d for d in (1, 2, 4, 8) if (8 // pp) % d == 0):
            tp = 8 // (pp * dp)
            zeros = (0, 1, 3) if pp < 8 else (0, 1)
            for zero in zeros:
                if pp == 8:  # 8 stages of the 8 layers: one stage per rank
                    schedule = ("1f1b", "gpipe")[zero % 2]
                else:
                    schedule = _SCHEDULES[turn % len(_SCHEDULES)]
                turn += 1
                # accumulation halves each dp rank's batch of 16 / dp: microbatches must divide 8 / dp
                micro = min(2 * pp, 8 // dp) if pp > 1 else None
                layouts.append(Layout(8, pp, dp, tp, zero, schedule, microbatches=micro))
    return layouts


WORLD8 = _world8() + [
    Layout(8, 2, 2, 2, zero=2, schedule="1f1b", sp=True),
    Layout(8, 4, 2, 1, zero=1, schedule="interleaved_1f1b", balance="params", microbatches=4),
    # world 4, moved from `make test` (test budget): tp=4, dp=4, dp2 x tp2 ZeRO-1 with SP, pp=4 by params
    Layout(4, 1, 1, 4),
    Layout(4, 1, 4, 1),
    Layout(4, 1, 2, 2, zero=1, sp=True),
    Layout(4, 4, 1, 1, balance="params"),
    # moved later (test budget): dp2 x tp2 at ZeRO 0-2 (ZeRO-3 stays; the overlap and precision tests run dp2 x tp2
    # at ZeRO 0 and 1 in `make test`), zero_bubble beside dp (it stays beside tp with SP)
    Layout(4, 1, 2, 2),
    Layout(4, 1, 2, 2, zero=1),
    Layout(4, 1, 2, 2, zero=2),
    Layout(4, 2, 2, 1, zero=2, schedule="zero_bubble"),
    # the two schedules added last, by their row in schedules.py alone: beside dp with ZeRO, and beside tp
    Layout(4, 2, 2, 1, zero=1, schedule="looped_bfs"),
    Layout(4, 2, 1, 2, schedule="interleaved_zero_bubble", microbatches=2),
]


META = Layout(4, 2, 1, 2, zero=1)
VGG_CASES = [{"name": "vgg", "model": "vgg", "steps": 4, "validate": True}]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Batch:
    """Every run of ``make test`` here, one launch per world size."""
    runs = {lay.id: (lay.world, lay.spec, PARITY_CASES) for lay in LAYOUTS}
    runs["meta"] = (4, META.spec, [{**PARITY_CASES[0], "meta": True}])
    # one microbatch: BatchNorm's batch statistics then cover the same samples as in one process
    runs["vgg-pp2"] = (2, "hybrid3d:pp=2,pp_schedule=gpipe,microbatches=1", VGG_CASES)
    return Batch(tmp_path_factory, runs)


def world8_cases(layout: Layout) -> list[dict]:
    return deep(PARITY_CASES) if layout.deep else PARITY_CASES


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.id)
def test_parity(layout, reference, matrix):
    check_against_reference(matrix[layout.id], reference, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", WORLD8, ids=lambda lay: lay.id)
def test_parity_world8(layout, request, tmp_path_factory):
    # one launch per layout: one process group through all 31 layouts kept every mesh's gloo groups (torch caches
    # DTensor layouts by mesh value, so an earlier equal mesh and its groups may still be used: they cannot be
    # destroyed early), and their hundreds of threads slowed the last layouts tenfold
    reference = request.getfixturevalue("deep_reference" if layout.deep else "reference")
    run = launch(tmp_path_factory, layout.spec, layout.world, world8_cases(layout))
    check_against_reference(run, reference, layout, world8_cases(layout))


def test_meta_device_build(reference, matrix):
    """Built in configure_model under pp: layers start on the meta device, each rank materializes its stage."""
    run = matrix["meta"]
    for rank in range(META.world):
        assert run.case("plain", rank)["built_on"] == "meta", f"rank {rank} built real tensors"
    assert_same_losses(run.losses("plain", [0]), reference.losses("plain"), "meta build")
    assert_same_params(run.params("plain"), reference.params("plain"), "meta build")


def test_batchnorm_running_statistics_under_pipeline(matrix, tmp_path_factory):
    """torch's shape inference runs stages on placeholder inputs; BatchNorm statistics must not see it."""
    single = launch(tmp_path_factory, "auto", 1, VGG_CASES, tag="vgg")
    run = matrix["vgg-pp2"]
    assert_same_losses(run.losses("vgg", [0]), single.losses("vgg"), "vgg pp=2")
    assert_same_params(run.params("vgg"), single.params("vgg"), "vgg pp=2 (running statistics included)")
    want = single.case("vgg")["val_loss"]
    assert abs(run.case("vgg", 1)["val_loss"] - want) <= 1e-5 * want
