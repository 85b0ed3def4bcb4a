#!/usr/bin/env bash
# Quick start, command 2: set up, then lint and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tppc tests benchmarks examples
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@" tests
