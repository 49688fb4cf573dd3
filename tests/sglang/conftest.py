"""SGLang tests run in the SGLang venv only (``bash scripts/setup_sglang.sh``, then
``.venv-sglang/bin/python -m pytest tests/sglang``); elsewhere they are not collected."""

import importlib.util

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
