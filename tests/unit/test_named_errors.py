"""Bad arguments that used to crash (AssertionError, KeyError, IndexError, ZeroDivisionError,
a 256 GB allocation) or mislead are refused by name: the thing, the value and the fix.

Each refusal is checked to come before any work (no capture, no file, no allocation), and
where a fix is named, following it is checked against eager torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc import errors
from tppc.errors import CaptureError, RuntimeInputError, SpecError
from tppc.examples import gpt
from tppc.program.actions import flow_shop
from tppc.program.schedule import check_actions

SEQ = 16


@pytest.fixture(scope="module")
def compiled():
    model, args, kwargs = gpt(seq_len=SEQ, n_layer=2)
    with torch.no_grad():
        cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=2)
    return model, args, cp


def _no_capture(monkeypatch) -> None:
    def refuse(*_, **__):
        raise AssertionError("captured before the argument was refused")
    monkeypatch.setattr("tppc.frontend.capture.export_dynamic", refuse)


def test_a_cuda_device_this_machine_lacks_is_refused(monkeypatch) -> None:
    model, args, kwargs = gpt(seq_len=SEQ, n_layer=2)
    absent = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    _no_capture(monkeypatch)
    with pytest.raises(SpecError, match=f"devices contains '{absent}', but this machine has "
                                        r".*fix: pass devices=None"):
        tppc.compile(model, args, kwargs, devices=(absent, "cpu"))
    with pytest.raises(SpecError, match="devices contains 'gpu7', which is not a torch device"):
        tppc.compile(model, args, kwargs, devices=("gpu7", "cpu"))


def test_an_unknown_executor_is_refused_at_compile_and_per_call(compiled, monkeypatch) -> None:
    model, args, cp = compiled
    with pytest.raises(SpecError, match=r"executor='bogus'; use one of \['local', 'threads', "
                                        r"'distributed'\]"):
        tppc.compile(model, args, executor="bogus")
    with pytest.raises(SpecError, match="executor='bogus'; use one of"):
        cp.run(args, executor="bogus")
    with pytest.raises(SpecError, match=r"executor='distributed' is not available in this "
                                        r"pipeline \(it has \['local', 'threads'\]\)"):
        cp.run(args, executor="distributed")
    with torch.no_grad():  # the pipeline still works, and equals eager
        assert_kernels_close(cp.run(args, executor="local"), model(*args))


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "5", True])
def test_invalid_time_limits_and_timeouts_are_refused(compiled, monkeypatch, value) -> None:
    model, args, cp = compiled
    text = f"={value!r} must be a positive number of seconds"
    with pytest.raises(SpecError, match="timeout" + _re(text)):
        cp.run(args, timeout=value)
    _no_capture(monkeypatch)
    with pytest.raises(SpecError, match="time_limit" + _re(text)):
        tppc.plan(model, args, time_limit=value)
    for name in ("timeout", "time_limit"):
        with pytest.raises(SpecError, match=name + _re(text)):
            tppc.compile(model, args, **{name: value})


@pytest.mark.parametrize("steps,warmup,name", [(-3, 1, "num_inference_steps=-3"),
                                               (0, 1, "num_inference_steps=0"),
                                               (2.5, 1, "num_inference_steps=2.5"),
                                               (4, 0, "warmup_steps=0")])
def test_invalid_denoising_step_counts_are_refused(compiled, steps, warmup, name) -> None:
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.DDIMScheduler()
    with pytest.raises(SpecError, match=_re(name) + r"; .* fix: pass an integer \w+ >= 1"):
        compiled[2].denoise(torch.randn(1, 4, 8, 8), scheduler, steps, warmup_steps=warmup)
    assert scheduler.num_inference_steps is None  # refused before the scheduler was set


@pytest.mark.parametrize("lengths,text", [([0], "lengths contains 0"),
                                          ([-3], "lengths contains -3"),
                                          ([16, "x"], "lengths contains 'x'"),
                                          ([True], "lengths contains True"),
                                          ("128", "lengths='128' must be a list")])
def test_invalid_export_lengths_are_refused(compiled, tmp_path, lengths, text) -> None:
    out = tmp_path / "artifact"
    with pytest.raises(tppc.ExportError, match=_re(text) + ".*fix: e.g. lengths=\\[128, 256\\]"):
        tppc.export(compiled[2], out, lengths=lengths)
    assert not out.exists()


def test_every_error_class_is_importable_from_tppc() -> None:
    """``except tppc.ExportError`` and ``except tppc.ScheduleError`` work (as every other
    :class:`tppc.TppcError` of ``tppc/errors.py``), and catch what tppc raises."""
    classes = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, errors.TppcError)}
    assert {"ExportError", "ScheduleError"} <= classes <= set(tppc.__all__)
    assert all(getattr(tppc, name) is getattr(errors, name) for name in classes)
    (row,) = flow_shop(((0, 1), (1, 2)), 1)
    with pytest.raises(tppc.ScheduleError, match="computes C0.1 before chunk 0"):
        check_actions((row, row[::-1]))  # stage 1 runs chunk 1 before chunk 0


def test_an_empty_batch_is_refused_at_compile_and_per_call(compiled, monkeypatch) -> None:
    model, args, cp = compiled
    empty = args[0][:0]
    with pytest.raises(RuntimeInputError, match=r"input 'input_ids' has batch size 0 \(shape "
                                                r"\(0, 16\)\).*fix: pass at least one"):
        cp(empty)
    with pytest.raises(RuntimeInputError, match="batch size 0"):
        cp.generate(empty, max_new_tokens=2)
    _no_capture(monkeypatch)
    with pytest.raises(CaptureError, match=r"example input 'input_ids' of GPT has batch size "
                                           r"0 \(shape \(0, 16\)\)"):
        tppc.compile(model, (empty,))


def test_a_one_token_example_names_the_token_count_and_the_fix() -> None:
    model, args, _ = gpt(seq_len=SEQ, n_layer=2)
    with pytest.raises(CaptureError, match=r"input_ids is int64 of shape \(1, 1\): 1 token\(s\)"
                                           r".*fix: pass an example of at least 2 tokens"):
        tppc.compile(model, (args[0][:, :1],))
    cp = tppc.compile(model, (args[0][:, :2],), chunks=1)  # the fix: 2 tokens, then 1 runs
    with torch.no_grad():
        assert_kernels_close(cp(args[0][:, :1]), model(args[0][:, :1]))


def test_a_float_example_of_token_ids_names_the_dtype_and_the_fix() -> None:
    model, args, _ = gpt(seq_len=SEQ, n_layer=2)
    with pytest.raises(CaptureError, match=r"input_ids is float32 of shape \(1, 16\): token "
                                           r"ids are integers.*fix: pass input_ids as integer "
                                           r"token ids \(input_ids.long\(\)\)"):
        tppc.compile(model, (args[0].float(),))


def test_generating_past_the_memory_is_refused_with_the_numbers(compiled, monkeypatch) -> None:
    """10**9 new tokens: refused at once, naming the need computed from the model's shape."""
    model, args, cp = compiled
    cfg = model.cfg
    total = SEQ + 10**9
    kv = cfg.n_layer * 2 * cfg.n_embd * 4 * total  # K and V rows of every layer, float32
    ids = 8 * total  # the token ids, grown to the full length (int64)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeInputError) as info:
        cp.generate(args[0], max_new_tokens=10**9)
    assert time.perf_counter() - t0 < 5
    message = str(info.value)
    assert f"{total} tokens need {(kv + ids) / 2**30:,.1f} GiB on cpu" in message, message
    assert "fix: lower max_new_tokens to at most" in message
    free = 2**30  # a machine with 1 GiB free: the named bound is what fits in it
    monkeypatch.setattr("tppc.calls.kv_memory.free_bytes", lambda device: free)
    with pytest.raises(RuntimeInputError) as info:
        cp.generate(args[0], max_new_tokens=10**9)
    fits = int(free / ((kv + ids) / total)) - SEQ
    assert f"max_new_tokens to at most {fits}" in str(info.value)
    assert math.isclose(fits, free / (cfg.n_layer * 2 * cfg.n_embd * 4 + 8) - SEQ, abs_tol=2)
    out = cp.generate(args[0], max_new_tokens=3)  # the pipeline is unchanged
    torch.testing.assert_close(out, greedy_reference(model, args[0], 3))


def _re(text: str) -> str:
    """``text`` as a literal regular expression."""
    return re.escape(text)


@pytest.mark.parametrize("name", ["comm_timeout", "timeout"])
@pytest.mark.parametrize("value", [0, -2.5, float("nan"), float("inf"), "30"])
def test_invalid_launch_limits_are_refused_before_any_rank_starts(monkeypatch, name,
                                                                  value) -> None:
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SpecError, match=name + _re(f"={value!r} must be a positive number")):
        tppc.launch("tppc.examples:gpt", 2, **{name: value})


def test_a_granularity_larger_than_the_example_is_refused_before_planning(monkeypatch) -> None:
    """It crashed the compile's check with a raw IndexError (its probe length, 16 + 2000
    tokens, was past GPT's 1024 positions)."""
    model, args, kwargs = gpt(seq_len=SEQ, n_layer=2)
    with monkeypatch.context() as patch:
        patch.setattr("tppc.driver.planning.length_planner",
                      lambda *_, **__: pytest.fail("planned before the granularity was refused"))
        patch.setattr("tppc.dispatch.compile.validate_pipeline",
                      lambda *_, **__: pytest.fail("validated before the granularity was refused"))
        with pytest.raises(errors.PlanError, match=r"granularity=2000 is larger than the example "
                                                   r"of GPT, which has 16 tokens.*fix: pass "
                                                   r"granularity <= 16"):
            tppc.compile(model, args, kwargs, granularity=2000)
    cp = tppc.compile(model, args, kwargs, granularity=SEQ)  # the fix: at most the example
    with torch.no_grad():
        assert_kernels_close(cp(*args), model(*args))


def test_a_scheduler_class_is_refused_by_both_denoise_loops(compiled) -> None:
    """``denoise(x, DDIMScheduler, ...)`` (the class) raised a raw TypeError from
    ``set_timesteps``; the compiled pipeline and a loaded artifact refuse it alike."""
    diffusers = pytest.importorskip("diffusers")
    from tppc.artifact.torch_runners.denoise import denoise_loaded

    latents = torch.randn(1, 4, 8, 8)
    text = r"scheduler=DDIMScheduler is a class, not a scheduler.*fix: pass an instance: " \
           r"DDIMScheduler\(\)"
    with pytest.raises(SpecError, match=text):
        compiled[2].denoise(latents, diffusers.DDIMScheduler, 4)
    with pytest.raises(SpecError, match=text):  # refused before the artifact's runner is read
        denoise_loaded(None, latents, diffusers.DDIMScheduler, 4)


def test_inputs_on_the_meta_device_are_refused_at_bind(compiled, monkeypatch) -> None:
    """They crashed in the executor ("Cannot copy out of meta tensor") inside stage 0."""
    model, args, cp = compiled
    meta = args[0].to("meta")
    monkeypatch.setattr(type(cp), "execute",
                        lambda *_, **__: pytest.fail("a stage ran before the input was refused"))
    text = r"input 'input_ids' is on the meta device \(shape \(1, 16\)\).*fix: pass real tensors"
    for executor in ("local", "threads"):
        with pytest.raises(RuntimeInputError, match=text):
            cp.run((meta,), executor=executor)
    with pytest.raises(RuntimeInputError, match=text):
        cp.generate(meta, max_new_tokens=2)
    monkeypatch.undo()
    real = torch.empty_like(meta, device="cpu").copy_(args[0])  # the fix: a tensor with data
    with torch.no_grad():
        assert_kernels_close(cp(real), model(*args))


@dataclasses.dataclass
class _Output:
    """A model output no pytree knows (not a transformers ModelOutput)."""
    logits: torch.Tensor
    pair: tuple[torch.Tensor, torch.Tensor]
    note: str | None = None


class _DataclassOutput(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> _Output:
        logits = self.inner(input_ids)
        return _Output(logits=logits, pair=(logits * 2, logits.softmax(-1)))


def test_a_dataclass_output_is_captured_and_returned_as_that_dataclass() -> None:
    """It was refused as "CaptureError: torch.export could not capture ... at <string>:1 ()"
    (torch.export flattens only registered types): tppc registers it, as a user would."""
    inner, args, _ = gpt(seq_len=SEQ, n_layer=2)
    model = _DataclassOutput(inner).eval()
    cp = tppc.compile(model, args, num_stages=2, chunks=2)
    with torch.no_grad():
        got, want = cp(*args), model(*args)
    assert type(got) is _Output and got.note is None
    for name in ("logits", "pair"):
        assert_kernels_close(getattr(got, name), getattr(want, name))
    assert not model._forward_hooks  # the hook that registered it was on the traced copy


class _Box:
    """A plain class holding a tensor: no pytree flattens it."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _BoxOutput(_DataclassOutput):
    def forward(self, input_ids: torch.Tensor) -> _Box:  # type: ignore[override]
        return _Box(self.inner(input_ids))


def test_an_output_of_an_unknown_class_names_the_class_and_the_fix() -> None:
    """Was "could not capture ... at <string>:1 ()": a location in generated code."""
    inner, args, _ = gpt(seq_len=SEQ, n_layer=2)
    with pytest.raises(CaptureError, match=r"could not capture _BoxOutput: an input or output "
                                           r"of a type .*: (tests\.unit\.)?test_named_errors\._Box"
                                           r"\.\nfix: return tensors in a tuple, a dict or a "
                                           r"dataclass") as info:
        tppc.compile(_BoxOutput(inner).eval(), args)
    assert "<string>" not in str(info.value)


def test_wrong_sizes_are_named_before_any_capture(monkeypatch) -> None:
    """A latent with 3 channels, an odd width (a static axis) or an odd height (the sequence
    axis, in patch rows of 2) into a DiT compiled with (4, 8, 8): the model's own forward on
    fake tensors fails, and the error names the input, the axis, both sizes and the model's
    own error before any capture (was: a re-capture that failed inside torch.export for the
    channels; the odd height silently ran 4 patch rows where the model fails)."""
    from tppc.examples.models.dit import DiT, DiTConfig

    torch.manual_seed(0)
    model = DiT(DiTConfig(hidden=32, depth=1, n_head=2)).eval()
    t, y = torch.tensor([3]), torch.tensor([1])
    cp = tppc.compile(model, (torch.randn(1, 4, 8, 8), t, y))
    _no_capture(monkeypatch)

    def refuse(*_, **__):
        raise AssertionError("captured before the sizes were refused")
    monkeypatch.setattr("tppc.pipeline.captures.capture_front_end", refuse)
    with pytest.raises(RuntimeInputError, match=r"^input 'x' axis 1 is 3, compiled with 4: DiT "
                       r"itself fails at these sizes \(RuntimeError: Given groups=1, weight of "
                       r"size \[32, 4, 2, 2\], expected input\[1, 3, 8, 8\] to have 4 channels"
                       r".*\), so no capture was tried\. fix: pass the sizes DiT was compiled "
                       r"with on those axes"):
        cp(torch.randn(1, 3, 8, 8), t, y)
    with pytest.raises(RuntimeInputError, match=r"^input 'x' axis 3 is 9, compiled with 8: DiT "
                       r"itself fails at these sizes \(RuntimeError: shape '\[1, 4, 8, 9\]' is "
                       r"invalid"):
        cp(torch.randn(1, 4, 8, 9), t, y)
    with pytest.raises(RuntimeInputError, match=r"^input 'x' axis 2 is 9, not a whole number of "
                       r"its units of 2 \(compiled as 2·n\): DiT itself fails at 9 \(RuntimeError"
                       r": shape '\[1, 4, 9, 8\]' is invalid .*\)\. fix: pass a multiple of 2 "
                       r"on axis 2 of 'x' \(8 or 10\)$"):
        cp(torch.randn(1, 4, 9, 8), t, y)
    x = torch.randn(1, 4, 10, 8)  # the fix: a whole number of patch rows, same capture
    with torch.no_grad():
        torch.testing.assert_close(cp(x, t, y), model(x, t, y), rtol=0, atol=0)
