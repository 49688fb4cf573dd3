"""What the tests share; no test module imports another.

- ``models``: ``TinyNet``, its stand-in optimizer ``step``, ``digests`` (bit-exact comparison),
  ``holder_module``, and ``tiny_config``, the tiny transformers configs every engine test uses.
- ``targets``: drive a ``WeightTarget`` without a sender: ``drive``, ``manifest_of``,
  ``random_weights``.
- ``processes``: a sender on a short unix socket path (``unix_sender``, ``socket_dir``),
  receivers in their own processes (``start_receivers``, ``publish_versions``, then
  ``next_outcomes`` and ``assert_applied``) or in a thread (``sync_in_thread``); whether a
  process still runs, and under which parent (``parent_of``).
- ``waiting``: ``wait_until(condition, timeout, message)`` instead of polling loops and sleeps.
- ``bench``: ``weightsync bench`` in the test's process.
- ``devices``: ``DEVICES``, a test's CPU case and its CUDA case (marked ``gpu``).
- ``vllm``, ``megatron``, ``sglang``: per-engine helpers, imported only by that engine's tests.
  ``sglang`` runs in the SGLang venv (its own torch, no vLLM, no megatron) and imports neither
  of the other two.

The names below (torch and the weightsync core only) are imported from ``tests.support``.
"""

from tests.support.models import TinyNet, digests, holder_module, step, tiny_config
from tests.support.processes import (
    assert_applied,
    next_outcomes,
    publish_versions,
    socket_dir,
    start_receivers,
    sync_in_thread,
    unix_sender,
)
from tests.support.targets import drive, manifest_of, random_weights
from tests.support.waiting import wait_until

__all__ = [
    "assert_applied",
    "digests",
    "drive",
    "holder_module",
    "manifest_of",
    "next_outcomes",
    "publish_versions",
    "random_weights",
    "socket_dir",
    "start_receivers",
    "step",
    "sync_in_thread",
    "tiny_config",
    "TinyNet",
    "unix_sender",
    "wait_until",
]
