#!/usr/bin/env bash
# The test suite, exactly as CI runs it (.ci/run): set up the cached venv, lint, run pytest.
# GPU tests (marker `gpu`) are skipped here; run them on a GPU machine with `-m gpu`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
.venv/bin/python -m ruff check .
# Two workers, a test module each at a time (module-scoped engines and senders stay in one
# process): most tests wait on sockets, subprocesses and engines, so two overlap well here.
# "loadgroup" is loadfile, except that the modules of one xdist_group (those sharing one vLLM
# server) go to one worker together (tests/conftest.py).
.venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
# SGLang pins a CUDA torch; its model classes get their own light venv (scripts/setup_sglang.sh).
bash scripts/setup_sglang.sh
.venv-sglang/bin/python -m pytest tests/sglang
