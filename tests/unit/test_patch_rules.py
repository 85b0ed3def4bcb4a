"""PipeFusion's patch rules (``tppc/program/patches.py``), one copy for torch and numpy: the
torch pipeline's and the numpy artifact's operations give the same timestep input and the
same refusal; bounds, rows per unit and the program choice against hand-computed values."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import sympy
import torch

from tppc.artifact.torch_runners.denoise import NUMPY_TIMESTEPS
from tppc.errors import SpecError
from tppc.pipefusion.denoise import TORCH_TIMESTEPS
from tppc.program.patches import (
    PatchPrograms,
    cached_patch_programs,
    latent_axis,
    model_timestep,
    patch_bands,
    patch_bounds,
    rows_per_unit,
)


def test_patch_bounds_are_equal_bands_rounded() -> None:
    assert patch_bounds(3, 8) == (0, 3, 5, 8)  # 8/3 = 2.67 -> 3, 16/3 = 5.33 -> 5
    assert patch_bounds(1, 5) == (0, 5)
    assert patch_bands([(0, 3), (3, 5), (5, 8)], 2) == ((0, 6), (6, 10), (10, 16))


@pytest.mark.parametrize("patches", [0, 9, True, 2.0, "2"])
def test_patch_counts_outside_one_to_the_length_are_refused(patches) -> None:
    with pytest.raises(SpecError, match=r"the latent has 8 patch rows. fix: 1 <= patches <= 8"):
        patch_bounds(patches, 8)


def test_rows_per_unit_is_the_integer_coefficient_of_the_captured_size() -> None:
    s = sympy.Symbol("s", positive=True, integer=True)

    def sym(expr):  # what a torch.SymInt exposes
        return SimpleNamespace(node=SimpleNamespace(expr=expr))

    assert [rows_per_unit(sym(2 * s)), rows_per_unit(sym(s)), rows_per_unit(16)] == [2, 1, 1]
    assert rows_per_unit(sym(s / 2)) == 1  # not a whole number of positions per unit


def test_the_latent_axis_is_the_first_sequence_axis_and_its_rows() -> None:
    assert latent_axis("x", (2, 3), (2, 2)) == (2, 2)
    assert latent_axis("x", [1], None) == (1, 1)
    with pytest.raises(SpecError, match="'x' has no sequence axis.*fix: pass the latents"):
        latent_axis("'x'", (), None)


@pytest.mark.parametrize("t,want", [(torch.tensor(999), "float32"),
                                    (torch.tensor(500.0), "int64"),
                                    (torch.tensor([3.0, 4.0]), "float32")])
def test_torch_and_numpy_give_the_same_timestep_input(t, want) -> None:
    transform = (lambda v: v / 1000) if t.dtype.is_floating_point and want == "float32" \
        else None
    got_torch = model_timestep(t, 2, transform, getattr(torch, want), TORCH_TIMESTEPS, "t")
    got_numpy = model_timestep(t, 2, transform, np.dtype(want), NUMPY_TIMESTEPS, "t")
    expect = (t.expand(2) if t.dim() == 0 else t)
    expect = (transform(expect) if transform else expect).to(getattr(torch, want))
    assert got_torch.dtype == getattr(torch, want) and torch.equal(got_torch, expect)
    assert got_numpy.dtype == np.dtype(want) and np.array_equal(got_numpy, expect.numpy())


def test_a_fractional_timestep_into_an_integer_input_is_refused_by_both() -> None:
    t = torch.tensor(999.5)
    with pytest.raises(SpecError, match=r"timesteps are torch.float32 \(999.5\), the pipeline's "
                                        r"'t' input was compiled as torch.int64.*fix: compile"):
        model_timestep(t, 1, None, torch.int64, TORCH_TIMESTEPS, "t")
    with pytest.raises(SpecError, match=r"timesteps are float32 \(999.5\), the artifact's 't' "
                                        r"input is int64.*fix: export with a float32"):
        model_timestep(t, 1, None, np.dtype("int64"), NUMPY_TIMESTEPS, "t")


def test_the_first_patch_runs_the_first_program_and_the_later_ones_the_rest() -> None:
    assert [PatchPrograms("w", "f", "r").of_patch(m) for m in range(3)] == ["f", "r", "r"]
    assert [PatchPrograms("w", "f", None).of_patch(m) for m in range(3)] == ["f", "f", "f"]


def test_patch_programs_are_built_once_per_shape_length_bounds_and_placement() -> None:
    built = []

    def build(graph, chunks):
        built.append((graph, chunks))
        return (graph, chunks)

    def plan(*cuts):
        return SimpleNamespace(stages=[SimpleNamespace(layer_start=a, layer_end=b,
                                                       device_index=d)
                                       for d, (a, b) in enumerate(cuts)])

    cache: dict = {}
    two = plan((0, 2), (2, 4))
    got = cached_patch_programs(cache, two, (1,), 8, (0, 4, 8), build, "gm", "rest")
    assert got == PatchPrograms(("gm", ((0, 8),)), ("gm", ((0, 4), (4, 8))),
                                ("rest", ((0, 4), (4, 8))))
    assert cached_patch_programs(cache, two, (1,), 8, (0, 4, 8), build, "gm", "rest") == got
    assert len(built) == 3  # the second call is served from the cache
    cached_patch_programs(cache, plan((0, 1), (1, 4)), (1,), 8, (0, 4, 8), build, "gm", None)
    assert len(built) == 5 and len(cache) == 2  # another placement, no rest graph
