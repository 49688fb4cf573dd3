#!/usr/bin/env bash
# Builds (once) the heavy venv, cached outside the clone and keyed by the hash of
# requirements/ci.txt, so a fresh clone on the same machine reuses it; then makes ./.venv, a
# light venv of this clone on top of it with this checkout installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh

after_install() {
  # PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm` on CPU torch.
  "$1" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$1" -c "import torch, vllm, megatron.core, transformers, grpc_tools, build"
}

cached_venv requirements/ci.txt venv
clone_venv "$CACHED_VENV" .venv
