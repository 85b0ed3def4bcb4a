"""The tests' shared oracles: the kernel tolerance passes rounding and fails wrong results,
and the serial loop and greedy reference compute what their docstrings say."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracles import assert_kernels_close, greedy_reference, kernel_tolerance, serial_denoise


def test_a_sum_in_another_order_passes_at_depth_one() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(64, 256), torch.randn(256, 64)
    want = a @ b
    got = (a.double() @ b.double()).float()  # another kernel, rounded once
    serial = (a[:, :, None] * b[None]).cumsum(dim=1)[:, -1]  # one term after the other
    assert not torch.equal(serial, want)  # the orders do round differently
    assert_kernels_close(got, want)
    assert_kernels_close(serial.numpy(), want.numpy())


@pytest.mark.parametrize("depth", [1, 3, 10])
def test_a_wrong_result_fails_at_every_depth(depth: int) -> None:
    want = torch.randn(4, 16)
    wrong = want.clone()
    wrong[1, 3] += 0.01 * want.abs().max()  # one value off by 1% of the largest
    with pytest.raises(AssertionError):
        assert_kernels_close(wrong, want, depth=depth)


def test_the_tolerance_scales_with_the_values_and_the_depth() -> None:
    small, large = torch.full((3,), 0.5), torch.full((3,), 40.0)
    eps = torch.finfo(torch.float32).eps
    assert kernel_tolerance(small) == kernel_tolerance(torch.ones(3)) == 2048 * eps
    assert kernel_tolerance(large) == 40 * kernel_tolerance(small)
    assert kernel_tolerance(small, depth=3) == 3 * kernel_tolerance(small)
    assert kernel_tolerance(np.ones(3)) == 2048 * np.finfo(np.float64).eps


class _Scheduler:
    """x ← x − out at each of the timesteps 30, 20, 10, scaling the model input by 2."""

    def set_timesteps(self, steps: int) -> None:
        self.timesteps = torch.tensor([30, 20, 10][:steps])

    def scale_model_input(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def step(self, out: torch.Tensor, t: torch.Tensor, x: torch.Tensor):
        return type("Out", (), {"prev_sample": x - out})()


def test_the_serial_loop_scales_calls_transforms_and_steps() -> None:
    seen = []

    def model(x, *, t, shift):
        seen.append(t.tolist())
        return (0.25 * x + shift, "ignored")

    x = torch.ones(2, 3)
    got = serial_denoise(model, x, _Scheduler(), 2, timestep_arg="t",
                         model_kwargs={"shift": 1.0}, output_transform=lambda o: o * 2,
                         timestep_transform=lambda t: t / 10)
    # each step: out = 2 · (0.25 · 2x + 1) = x + 2, so x ← x − (x + 2) = −2, then −2 again
    assert seen == [[3.0, 3.0], [2.0, 2.0]]
    torch.testing.assert_close(got, torch.full((2, 3), -2.0), rtol=0, atol=0)


def test_greedy_reference_appends_the_argmax_of_the_last_position() -> None:
    def model(ids):  # logits favour (last token + 1) mod 5
        return torch.nn.functional.one_hot((ids + 1) % 5, 5).float()

    got = greedy_reference(model, torch.tensor([[3]]), 4)
    assert got.tolist() == [[3, 4, 0, 1, 2]]


def test_a_float32_result_against_a_float64_reference_gets_float32s_tolerance() -> None:
    want = np.linspace(-1.0, 1.0, 7)  # float64
    assert_kernels_close((want + 1e-6).astype(np.float32), want)
    with pytest.raises(AssertionError):
        assert_kernels_close((want + 1e-2).astype(np.float32), want)
