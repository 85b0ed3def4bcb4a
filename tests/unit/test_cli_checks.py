"""The ``tppc`` command checks every number and path before the work: a bad one is one line
on stderr (``tppc: error: <option> <value> ... fix: ...``), exit status 2, nothing written,
the model never loaded; it never overwrites its input."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tppc.cli.main import main

CLI = importlib.import_module("tppc.cli.main")  # ``tppc.cli.main`` is also the function
UNWRITABLE = Path("/sys")  # refuses a new file even to root (a chmod does not)


@pytest.fixture
def no_work(monkeypatch):
    """Every subcommand's work fails the test: the factory, the artifact runner."""
    def work(*_, **__):
        pytest.fail("the command started its work before refusing an argument")
    monkeypatch.setattr(CLI, "load_factory", work)
    monkeypatch.setattr("tppc.cli.cost.load_factory", work)
    monkeypatch.setattr("tppc.artifact.core.run.run_artifact", work)


@pytest.fixture
def inputs(tmp_path) -> Path:
    path = tmp_path / "in.npz"
    np.savez(path, input_ids=np.zeros((1, 8), np.int64))
    return path


def _refused(argv: list[str], folder: Path, capsys, *texts: str) -> None:
    """``argv`` exits with 2 and one line naming ``texts``, leaving ``folder`` as it was."""
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tppc: error: ") and err.count("\n") == 1, err
    for text in texts:
        assert text in err, err
    assert "fix:" in err, err
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before


@pytest.mark.parametrize("option,value,text", [
    ("--out", "", "--out '' is empty"),
    ("--stages", "0", "--stages 0 must be an integer >= 1"),
    ("--stages", "-2", "--stages -2 must be an integer >= 1"),
    ("--chunks", "0", "--chunks 0 must be an integer >= 1"),
    ("--lengths", "0", "--lengths contains '0'"),
    ("--lengths", "32,x", "--lengths contains 'x'"),
])
def test_export_refuses_bad_numbers_and_an_empty_out(no_work, tmp_path, monkeypatch, capsys,
                                                     option, value, text) -> None:
    monkeypatch.chdir(tmp_path)  # --out '' used to export into the current directory
    argv = ["export", "tppc.examples:gpt", "--out", str(tmp_path / "art"), option, value]
    _refused(argv, tmp_path, capsys, text)
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_out_it_cannot_create(no_work, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    _refused(["export", "m:f", "--out", str(tmp_path / "file")], tmp_path, capsys,
             "is a file, not a directory")
    _refused(["export", "m:f", "--out", str(tmp_path / "file" / "art")], tmp_path, capsys,
             "is not a directory")
    if UNWRITABLE.is_dir():
        _refused(["export", "m:f", "--out", str(UNWRITABLE / "tppc-art")], tmp_path, capsys,
                 f"its directory '{UNWRITABLE}' is not writable")


@pytest.mark.parametrize("option,value,text", [
    ("--generate", "0", "--generate 0 must be an integer >= 1"),
    ("--threads", "0", "--threads 0 must be an integer >= 1"),
    ("--output", "", "--output '' is empty"),
])
def test_run_refuses_bad_numbers_and_an_empty_output(no_work, tmp_path, inputs, capsys,
                                                     option, value, text) -> None:
    argv = ["run", str(tmp_path), "--input", str(inputs), "--output", str(tmp_path / "o.npz"),
            option, value]
    _refused(argv, tmp_path, capsys, text)


@pytest.mark.parametrize("output", ["in.npz", "in", "./sub/../in.npz", "link.npz"])
def test_run_never_overwrites_its_input(no_work, tmp_path, inputs, monkeypatch, capsys,
                                        output) -> None:
    """``--output in`` too: numpy.savez appends .npz, so it would write ``in.npz``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    os.link(inputs, tmp_path / "link.npz")  # the same file under another name
    _refused(["run", "art", "--input", "in.npz", "--output", output], tmp_path, capsys,
             f"--output '{Path(output if output.endswith('.npz') else output + '.npz')}' is "
             "the input (--input 'in.npz')")
    assert dict(np.load(inputs)) .keys() == {"input_ids"}


def test_run_refuses_an_output_it_cannot_write_and_a_missing_input(no_work, tmp_path, inputs,
                                                                   capsys) -> None:
    base = ["run", str(tmp_path), "--input", str(inputs), "--output"]
    _refused([*base, str(tmp_path / "nowhere" / "o.npz")], tmp_path, capsys,
             f"its directory '{tmp_path / 'nowhere'}' does not exist")
    (tmp_path / "d.npz").mkdir()
    _refused([*base, str(tmp_path / "d.npz")], tmp_path, capsys, "is a directory")
    if UNWRITABLE.is_dir():
        _refused([*base, str(UNWRITABLE / "o.npz")], tmp_path, capsys, "is not writable")
    _refused(["run", str(tmp_path), "--input", str(tmp_path / "missing.npz"), "--output",
              str(tmp_path / "o.npz")], tmp_path, capsys, "--input", "is not a file")


@pytest.mark.parametrize("argv,text", [
    (["--steps", "0"], "--steps 0 must be an integer >= 1"),
    (["--granularity", "0"], "--granularity 0 must be"),
    (["--seq-len", "-4"], "--seq-len -4 must be"),
    (["--time-limit", "0"], "--time-limit 0.0 must be a positive number of seconds"),
    (["--time-limit", "nan"], "--time-limit nan must be"),
    (["--png", "NOWHERE/g.png"], "does not exist"),
    (["--trace", ""], "--trace '' is empty"),
])
def test_plan_refuses_bad_numbers_and_output_paths(no_work, tmp_path, capsys, argv,
                                                   text) -> None:
    argv = [a.replace("NOWHERE", str(tmp_path / "nowhere")) for a in argv]
    _refused(["plan", "tppc.examples:gpt", *argv], tmp_path, capsys, text)


@pytest.mark.parametrize("argv,text", [(["--chunk", "0"], "--chunk 0 must be"),
                                       (["--chunk", "8", "--prefix", "-1"], "--prefix -1"),
                                       (["--chunk", "8", "--device-index", "-1"],
                                        "--device-index -1 must be an integer >= 0")])
def test_cost_refuses_bad_numbers(no_work, tmp_path, capsys, argv, text) -> None:
    _refused(["cost", "tppc.examples:gpt", *argv], tmp_path, capsys, text)


def test_good_arguments_reach_the_work(tmp_path, inputs, monkeypatch) -> None:
    """The checks refuse nothing valid: a new nested --out (export creates its parents), an
    --output without .npz beside the input, --generate 3."""
    seen = []
    monkeypatch.setattr("tppc.artifact.core.run.run_artifact",
                        lambda *a, **k: seen.append((a, k)) or 0)
    assert main(["run", "art", "--input", str(inputs), "--output", str(tmp_path / "out"),
                 "--generate", "3"]) == 0
    assert seen == [(("art", str(inputs), str(tmp_path / "out")),
                     {"threads": None, "generate": 3, "expected_sha256": None})]
    monkeypatch.setattr(CLI, "load_factory", lambda name: seen.append(name) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # got past the checks to the factory
        main(["export", "m:f", "--out", str(tmp_path / "a" / "b"), "--lengths", "16,32"])
    assert seen[-1] == "m:f" and not (tmp_path / "a").exists()


_CONSOLE_SCRIPT = "import sys; from tppc.cli import main; sys.exit(main())"  # as pip writes it


def test_the_command_exits_2_with_one_line(tmp_path, inputs) -> None:
    """As a process: status 2, one line on stderr, nothing on stdout, the input unchanged."""
    data = inputs.read_bytes()
    done = subprocess.run([sys.executable, "-c", _CONSOLE_SCRIPT, "run", str(tmp_path),
                           "--input", str(inputs), "--output", str(inputs)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert "is the input" in done.stderr and inputs.read_bytes() == data


@pytest.mark.parametrize("argv,text", [
    (["--generate", "0"], "--generate 0 must be an integer >= 1"),
    (["--repeat", "0"], "--repeat 0 must be an integer >= 1"),
    (["--input", "IN", "--output", "IN"], "is the input (--input"),
    (["--output", "NOWHERE/o.npz"], "does not exist"),
])
def test_the_rank_entry_checks_its_arguments_before_loading(tmp_path, inputs, argv,
                                                            text) -> None:
    """``python -m tppc.run`` (one rank): status 1 and one line, as any rank error, before the
    model is built (a factory that does not exist is never imported)."""
    argv = [a.replace("IN", str(inputs)).replace("NOWHERE", str(tmp_path / "nowhere"))
            for a in argv]
    data = inputs.read_bytes()
    done = subprocess.run([sys.executable, "-m", "tppc.cli.rank", "no_such_module:f", *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "] SpecError: --" in done.stderr and text in done.stderr, done.stderr
    assert "no_such_module" not in done.stderr and inputs.read_bytes() == data
