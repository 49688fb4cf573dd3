#!/usr/bin/env bash
# The test suite, exactly as CI runs it (.ci/run): set up the cached venv, lint, run pytest.
# GPU tests (marker `gpu`) are skipped here; run them on a GPU machine with `-m gpu`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
.venv/bin/python -m ruff check .
# The kernels' CPU tests build our CUDA source with g++ and its sanitizer runtime (libubsan).
if [[ $(g++ -print-file-name=libubsan.so 2>/dev/null) != /* ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt-get install -y -q g++ >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q g++ >/dev/null; }
  else
    echo "test.sh: the tests need g++ with libubsan (Debian: apt-get install g++)" >&2
    exit 1
  fi
fi
# Two workers, a test module each at a time (module-scoped engines and senders stay in one
# process): most tests wait on sockets, subprocesses and engines, so two overlap well here.
# "loadgroup" is loadfile, except that the modules of one xdist_group (those sharing one vLLM
# server) go to one worker together (tests/conftest.py).
.venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
# SGLang pins a CUDA torch; its model classes get their own light venv (scripts/setup_sglang.sh).
bash scripts/setup_sglang.sh
.venv-sglang/bin/python -m pytest tests/sglang
