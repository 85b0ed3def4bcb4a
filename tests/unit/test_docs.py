"""The docs cannot drift from the code (README.md and docs/*.md).

- Every ```python block runs; the blocks of one page share a namespace, in page order (a page
  reads like a notebook). A block whose first line is ``# doc: skip (reason)`` is not run;
  such blocks are counted and kept few (:data:`MAX_SKIPPED`).
- Every ``tppc ...`` and ``python -m tppc.run ...`` / ``torchrun ... -m tppc.run ...``
  command, in a ```bash block or an inline code span, parses with the CLI's own argparse
  (``tppc.cli.main``, ``tppc.cli.rank``) without running; scripts named must exist.
- Every ``tppc/...`` (and ``tests/``, ``benchmarks/``, ``examples/``, ``scripts/``) path, every
  ``tppc.x.y`` name, every ``tppc.examples:NAME`` factory and every relative link (with its
  ``#anchor``) resolves.

A failure names the file and the line.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import re
import shlex
import traceback
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS = ROOT / "BENCHMARKS.md"
"""The record: only its links are checked (its table of contents)."""
MAX_SKIPPED = 4
"""Python blocks allowed to carry ``# doc: skip`` (they need torchrun or several processes)."""
SKIP = "# doc: skip"
SHELL = {"bash", "sh", "shell", "console"}
REPO_DIRS = ("tppc", "tests", "benchmarks", "examples", "scripts", "docs")
PATH_RE = re.compile(rf"(?<![\w./-])((?:{'|'.join(REPO_DIRS)})/[\w./*-]*[\w*])")
NAME_RE = re.compile(r"(?<![\w.:/-])tppc(?:\.\w+)+")
FACTORY_RE = re.compile(r"(?<![\w.])tppc\.examples:(\w+)")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, the line of its first code line, its code."""

    lang: str
    line: int
    code: str


@dataclass(frozen=True)
class Page:
    """A markdown file split into fenced blocks and the prose around them."""

    path: Path
    blocks: tuple[Block, ...]
    prose: str
    """The text with every fenced block blanked out (line numbers kept)."""

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1


@functools.cache
def read_page(path: Path) -> Page:
    lines = path.read_text().split("\n")
    blocks: list[Block] = []
    prose = list(lines)
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1:j]]
        blocks.append(Block(lang, i + 2, "\n".join(body)))
        for k in range(i, min(j + 1, len(lines))):
            prose[k] = ""
        i = j + 1
    return Page(path, tuple(blocks), "\n".join(prose))


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


# --- python blocks -------------------------------------------------------------------------


def _python_pages() -> list[Path]:
    return [p for p in DOCS if any(b.lang == "python" for b in read_page(p).blocks)]


@pytest.mark.parametrize("path", _python_pages(), ids=_ids(_python_pages()))
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = read_page(path)
    monkeypatch.chdir(tmp_path)  # blocks may write files (out/, plan.png)
    namespace: dict[str, Any] = {"__name__": f"doc:{page.name}"}
    for block in page.blocks:
        if block.lang != "python" or block.code.lstrip().startswith(SKIP):
            continue
        # padded so that a traceback's line numbers are the markdown file's
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        failure = None
        try:
            exec(code, namespace)
        except Exception as exc:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
            line = frames[-1].lineno if frames else block.line
            failure = (f"{page.name}:{line}: the block at line {block.line} raised "
                       f"{type(exc).__name__}: {exc}")
        if failure:
            pytest.fail(failure, pytrace=False)


def test_few_python_blocks_are_skipped() -> None:
    skipped = [(read_page(p).name, b) for p in DOCS for b in read_page(p).blocks
               if b.lang == "python" and b.code.lstrip().startswith(SKIP)]
    for name, block in skipped:
        first = block.code.lstrip().split("\n", 1)[0]
        assert re.fullmatch(re.escape(SKIP) + r" \(.+\)", first), (
            f"{name}:{block.line}: write the reason: '{SKIP} (needs torchrun)'")
    assert len(skipped) <= MAX_SKIPPED, (
        f"{len(skipped)} skipped python blocks (at most {MAX_SKIPPED}): "
        + ", ".join(f"{n}:{b.line}" for n, b in skipped))


# --- shell commands ------------------------------------------------------------------------


class _Parsed(Exception):
    pass


class _ArgError(Exception):
    pass


def _argparse_error(main: Callable[[list[str]], Any], argv: list[str]) -> str | None:
    """Parse ``argv`` with the parser ``main`` builds, stopping before it runs anything."""
    parse = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Parsed(parse(self, args, namespace))

    def error(self: argparse.ArgumentParser, message: str) -> Any:
        raise _ArgError(message)

    with (mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args),
          mock.patch.object(argparse.ArgumentParser, "error", error)):
        try:
            main(argv)
        except _Parsed:
            return None
        except _ArgError as exc:
            return str(exc)
    return "the command ran instead of parsing"


def _command_error(tokens: list[str], *, complete: bool) -> str | None:
    """Why ``tokens`` (one shell command) is not a valid tppc command, or None."""
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # TPPC_DEBUG=1 tppc ...
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "tppc":
        from tppc.cli.main import main

        err = _argparse_error(main, tokens[1:])
    elif "-m" in tokens[:-1] and tokens[tokens.index("-m") + 1] in ("tppc.run", "tppc.cli.rank"):
        from tppc.cli.rank import main

        err = _argparse_error(main, tokens[tokens.index("-m") + 2:])
    elif tokens[0] in ("python", "bash") or tokens[0].endswith("/python"):
        script = tokens[1] if len(tokens) > 1 else ""
        return None if (ROOT / script).is_file() else f"no file {script!r}"
    else:
        return None
    if err and not complete and err.startswith("the following arguments are required"):
        return None  # an inline span may name a command without its required arguments
    return err


def _commands(text: str) -> Iterator[tuple[int, list[str]]]:
    """``(line offset, tokens)`` of each shell command of ``text``: continuation lines joined,
    usage brackets (``[--generate 16]``) unwrapped, comments dropped."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        line = re.sub(r"(?<!\S)\[|\](?!\S)", " ", line)
        if tokens := shlex.split(line, comments=True):
            yield start, tokens


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_shell_commands_parse(path: Path) -> None:
    page = read_page(path)
    errors = []
    for block in page.blocks:
        if block.lang in SHELL:
            for offset, tokens in _commands(block.code):
                if err := _command_error(tokens, complete=True):
                    errors.append(f"{page.name}:{block.line + offset}: {shlex.join(tokens)}: {err}")
    for m in re.finditer(r"`([^`]+)`", page.prose):
        span = m.group(1).replace("\n", " ")
        if re.match(r"(tppc |torchrun |python -m tppc)", span):
            for _, tokens in _commands(span):
                if err := _command_error(tokens, complete=False):
                    errors.append(f"{page.name}:{page.line_of(m.start())}: `{span}`: {err}")
    assert not errors, "commands that the CLI would refuse:\n" + "\n".join(errors)


# --- names, paths, links -------------------------------------------------------------------


@functools.cache
def _meta_keys() -> frozenset[str]:
    """String constants ``"tppc.*"`` of the source (node-meta keys, schema names)."""
    keys = set()
    for file in (ROOT / "tppc").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"tppc(\.\w+)+", node.value):
                    keys.add(node.value)
    return frozenset(keys)


def _resolves(name: str) -> bool:
    """``tppc.a.b.c``: the longest importable module prefix, then attributes."""
    if name in _meta_keys():
        return True
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                continue
            raise
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    """GitHub's heading anchors of a markdown file (``## A b`` -> ``a-b``; repeats ``-1``...)."""
    anchors, counts = [], {}
    for line in read_page(path).prose.split("\n"):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).strip().lower()
        slug = "".join("-" if ch == " " else ch for ch in text
                       if ch in " -_" or unicodedata.category(ch)[0] in "LMN")
        count = counts.get(slug, 0)
        anchors.append(slug if count == 0 else f"{slug}-{count}")
        counts[slug] = count + 1
    return frozenset(anchors)


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_named_paths_modules_and_factories_exist(path: Path) -> None:
    page = read_page(path)
    text = page.path.read_text()  # code blocks included: their paths and names count too

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    errors = []
    for m in PATH_RE.finditer(text):
        found = list(ROOT.glob(m.group(1))) if "*" in m.group(1) else [ROOT / m.group(1)]
        if not any(p.exists() for p in found):
            errors.append(f"{line_of(m.start())}: no path {m.group(1)}")
    for m in NAME_RE.finditer(text):
        if not _resolves(m.group(0)):
            errors.append(f"{line_of(m.start())}: no module or name {m.group(0)}")
    examples = importlib.import_module("tppc.examples")
    for m in FACTORY_RE.finditer(text):
        if m.group(1) not in examples.__all__:
            errors.append(f"{line_of(m.start())}: no factory tppc.examples:{m.group(1)}")
    assert not errors, f"{page.name} names what does not exist:\n" + "\n".join(
        f"{page.name}:{e}" for e in errors)


@pytest.mark.parametrize("path", [*DOCS, BENCHMARKS], ids=_ids([*DOCS, BENCHMARKS]))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    page = read_page(path)
    errors = []
    for m in LINK_RE.finditer(page.prose):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            errors.append(f"{page.line_of(m.start())}: link to a missing file {target}")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            errors.append(f"{page.line_of(m.start())}: link to a missing heading {target}")
    assert not errors, f"{page.name} links to what does not exist:\n" + "\n".join(
        f"{page.name}:{e}" for e in errors)
