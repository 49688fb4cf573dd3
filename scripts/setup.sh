#!/usr/bin/env bash
# Builds (once) the heavy venv, cached outside the clone and keyed by the hash of
# requirements/ci.txt, so a fresh clone on the same machine reuses it; then makes ./.venv, a
# light venv of this clone on top of it with this checkout installed editable.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
py=${WEIGHTSYNC_PYTHON:-python3.11}
key=$(sha256sum requirements/ci.txt | cut -c1-16)
cache=${WEIGHTSYNC_VENV_CACHE:-$HOME/.cache/weightsync}
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "setup: building venv $venv (first run: a few minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  # pip warns about every missing local index folder; keep the log readable.
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" >&2 || true
  "$venv/bin/python" -m pip install -q -r requirements/ci.txt 2>&1 | grep -v "is ignored" >&2 || true
  # PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm` on CPU torch.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$venv/bin/python" -c "import torch, vllm, megatron.core, transformers, grpc_tools"
  touch "$venv/.complete"
fi
# Earlier layouts installed a clone into the shared venv itself; that must not linger there.
"$venv/bin/python" -m pip uninstall -q -y weightsync >/dev/null 2>&1 || true
source scripts/clone_venv.sh
clone_venv "$venv" .venv
