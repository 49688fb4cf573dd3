#!/usr/bin/env bash
# Builds (once) and links the project venv: ./.venv -> a cached venv keyed by the hash of
# requirements/ci.txt, so a fresh clone on the same machine reuses it.
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
# The project itself is installed editable on every run (seconds), pointing at this clone.
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || "$venv/bin/python" -m pip install --no-deps --no-build-isolation -e .
ln -sfn "$venv" .venv
