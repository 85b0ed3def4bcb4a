#!/usr/bin/env bash
# Quick start, command 1: set up, then run the main job (`tppc demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tppc demo "$@"
