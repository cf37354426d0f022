#!/usr/bin/env bash
# Create .venv with the pinned CPU torch and bitune (editable, with test/eval/plot extras). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/bitune ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet torch==2.13.0
  .venv/bin/pip install --quiet -e ".[dev]"
fi
