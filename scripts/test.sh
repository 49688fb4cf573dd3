#!/usr/bin/env bash
# The test suite, exactly as CI runs it (.ci/run): set up the cached venv, lint, run pytest.
# GPU tests (marker `gpu`) are skipped here; run them on a GPU machine with `-m gpu`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
.venv/bin/python -m ruff check .
# Tools the tests need beside the venvs, installed where they can be (root with apt-get): g++
# with its sanitizer runtime (the kernels' CPU tests build our CUDA source) and, as root,
# iproute2 (the network-namespace test). A missing one fails the run, not skips its tests.
missing=()
[[ $(g++ -print-file-name=libubsan.so 2>/dev/null) == /* ]] || missing+=(g++)
[[ $(id -u) != 0 ]] || command -v ip >/dev/null || missing+=(iproute2)
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive  # a package's question must not wait for an answer
    apt-get install -y -q "${missing[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
  else
    echo "test.sh: the tests need ${missing[*]} (Debian: apt-get install ${missing[*]})" >&2
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
