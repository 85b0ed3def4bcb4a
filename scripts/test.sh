#!/usr/bin/env bash
# Quick start, command 2: set up, then lint and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tppc tests benchmarks examples
# Two workers (the machine's two cores), each file whole on one worker so module fixtures are
# built once; tests pick free ports and name their own files, so they run side by side.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 "$@" tests
