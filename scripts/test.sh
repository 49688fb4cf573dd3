#!/usr/bin/env bash
# The test suite, exactly as CI runs it (.ci/run): set up the cached venv, lint, run pytest.
# GPU tests (marker `gpu`) are skipped here; run them on a GPU machine with `-m gpu`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"
# SGLang pins a CUDA torch; its model classes get their own light venv (scripts/setup_sglang.sh).
bash scripts/setup_sglang.sh
.venv-sglang/bin/python -m pytest tests/sglang
