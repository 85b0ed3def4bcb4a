#!/usr/bin/env bash
# Quick start, command 2: set up, then lint and run the test suite.
#   bash scripts/test.sh         every test not marked `slow` (what CI runs)
#   bash scripts/test.sh --all   every test, the `slow` ones too
# A `slow` test widens the net over a mechanism that an unmarked test already checks end to end
# (more families, plans or backends); tests/unit/test_suite_tiers.py keeps one unmarked test in
# every test module. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tppc tests benchmarks examples
tier=(-m "not slow")
if [[ "${1:-}" == "--all" ]]; then
  tier=()
  shift
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${tier[@]}" "$@" tests
