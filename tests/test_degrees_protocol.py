"""check_parallel_degrees: the model gets the layout as one ParallelDims; the earlier keyword form still runs, once
warned, with the degrees it names; a TypeError the model raises itself is its own."""

from __future__ import annotations

import pytest

from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.protocol import check_parallel_degrees

DIMS = ParallelDims.of(pp=2, tp=2, cp=2, ep=2)


class Seen:
    def __init__(self) -> None:
        self.got: dict = {}


class NewForm(Seen):
    def check_parallel_degrees(self, dims: ParallelDims) -> None:
        self.got = {"dims": dims}


class PpTp(Seen):
    def check_parallel_degrees(self, pp: int, tp: int) -> None:
        self.got = {"pp": pp, "tp": tp}


class WithCp(Seen):
    def check_parallel_degrees(self, *, pp: int, tp: int, cp: int = 1) -> None:
        self.got = {"pp": pp, "tp": tp, "cp": cp}


class WithEp(Seen):
    def check_parallel_degrees(self, pp: int = 1, tp: int = 1, ep: int = 1) -> None:
        self.got = {"pp": pp, "tp": tp, "ep": ep}


class AllFour(Seen):
    def check_parallel_degrees(self, pp: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        self.got = {"pp": pp, "tp": tp, "cp": cp, "ep": ep}


def test_dims_of_multiplies_out():
    assert (DIMS.pp, DIMS.tp, DIMS.cp, DIMS.ep, DIMS.dp, DIMS.world_size) == (2, 2, 2, 2, 2, 16)
    assert ParallelDims.of(tp=2).world_size == 2


def test_the_model_gets_one_dims_and_no_warning(recwarn):
    model = NewForm()
    check_parallel_degrees(model, DIMS)
    assert model.got == {"dims": DIMS}
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize(
    ("cls", "want"),
    [
        (PpTp, {"pp": 2, "tp": 2}),
        (WithCp, {"pp": 2, "tp": 2, "cp": 2}),
        (WithEp, {"pp": 2, "tp": 2, "ep": 2}),
        (AllFour, {"pp": 2, "tp": 2, "cp": 2, "ep": 2}),
    ],
)
def test_the_keyword_form_still_runs_warned(cls, want):
    model = cls()
    with pytest.warns(FutureWarning, match=rf"{cls.__name__}.check_parallel_degrees takes the degrees as keywords"):
        check_parallel_degrees(model, DIMS)
    assert model.got == want


def test_a_type_error_of_the_model_is_its_own():
    class Refuses:
        def check_parallel_degrees(self, dims: ParallelDims) -> None:
            raise TypeError(f"tp={dims.tp} needs a plan")

    with pytest.raises(TypeError, match="tp=2 needs a plan"):
        check_parallel_degrees(Refuses(), DIMS)


def test_a_module_without_the_method_passes():
    check_parallel_degrees(object(), DIMS)
