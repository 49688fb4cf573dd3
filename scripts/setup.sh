#!/usr/bin/env bash
# Builds (once) the heavy venv, cached outside the clone and keyed by the hash of
# requirements/ci.txt, so a fresh clone on the same machine reuses it; then makes ./.venv, a
# light venv of this clone on top of it with this checkout installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh

after_install() {
  # PyPI's torchaudio/torchcodec are CUDA-linked and break `import vllm` on CPU torch. So is its
  # torchvision, which vLLM's multimodal and Qwen3.5 modules import: it stays, with the op
  # schemas its import needs defined first (the hook below).
  "$1" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  "$1" -c "import runpy; runpy.run_path('tests/support/torchvision_ops.py')['define_missing_torchvision_ops']()
import torch, torchvision, vllm, megatron.core, transformers, grpc_tools, build
from vllm import LLM"
}

cached_venv requirements/ci.txt venv
clone_venv "$CACHED_VENV" .venv
# Every process of ./.venv (vLLM's subprocesses included) runs this hook, which defines
# torchvision's two missing op schemas when torchvision is first imported, without importing
# torch at startup. In the light venv, not the shared one: it follows this checkout's copy.
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp tests/support/torchvision_ops.py "$site/_weightsync_torchvision_ops.py"
echo "import _weightsync_torchvision_ops; _weightsync_torchvision_ops.define_ops_on_first_import()" \
  > "$site/_weightsync_torchvision_ops.pth"
