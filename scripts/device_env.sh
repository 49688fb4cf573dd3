#!/usr/bin/env bash
# Prepares the lent GPU machine (no registry there): installs the carried wheels (.whl/,
# see docs/gpu.md) and this project, editable. Source it: `source scripts/device_env.sh`
# (it returns 1 when an install fails and leaves the caller's shell options alone).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl \
  || return 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || return 1
