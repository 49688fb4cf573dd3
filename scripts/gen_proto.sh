#!/usr/bin/env bash
# Regenerates weightsync/v1/*_pb2*.py(i) from proto/. The one way stubs are made; the test
# tests/unit/test_proto_stubs.py runs the same generation into a temp dir and diffs.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo}
py=${PYTHON:-$repo/.venv/bin/python}
"$py" -m grpc_tools.protoc -I "$repo/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$repo"/proto/weightsync/v1/*.proto
