"""Run by Python at startup in every process whose ``PYTHONPATH`` holds this folder (``site``
imports ``sitecustomize``): ``tests.support.sglang_engine`` puts it there while it starts an
engine, so SGLang's spawned scheduler and detokenizer get the CPU shims before their first
``import sglang``. A process without ``WEIGHTSYNC_TEST_SGLANG_SHIMS=1`` is left alone."""

import os
import sys

if os.environ.get("WEIGHTSYNC_TEST_SGLANG_SHIMS") == "1":
    # The repository root, so `tests.support` imports in a process started from anywhere.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    from tests.support.sglang import install_cpu_shims

    install_cpu_shims()
