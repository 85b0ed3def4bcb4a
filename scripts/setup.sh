#!/usr/bin/env bash
# Set up .venv with tppc and everything its demo and tests need. Idempotent: a stamp keyed
# by the hash of pyproject.toml and constraints.txt skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), f"tppc needs Python 3.11+, {sys.executable} is {sys.version}"'
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
STAMP=.venv/.tppc-installed
WANT="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] || ! .venv/bin/python -c 'import tppc' 2>/dev/null; then
  echo "[setup] installing tppc[hf,viz,dev] with torch pinned by constraints.txt (a few minutes the first time)"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[hf,viz,dev]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c 'import torch, tppc, transformers, diffusers, pulp, highspy, onnxruntime, onnxscript, hypothesis; assert torch.__version__.startswith("2.13.0"), torch.__version__'
  echo "$WANT" > "$STAMP"
fi
