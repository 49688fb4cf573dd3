"""``weightsync bench``: sync time against the hardware floor and the peers' patterns.

Synthetic trainer shards with real model shapes (:mod:`.models`, :mod:`.layout`), an
engine-like receiver target (:mod:`.engine_like`), floors (:mod:`.floors`), peer baselines
(:mod:`.baselines`), the settings (:mod:`.config`), the run (:mod:`.runner`), each weightsync
case (:mod:`.cases`) and the report (:mod:`.report`).
"""

from weightsync.app.bench.config import CASES, BenchConfig
from weightsync.app.bench.runner import run

__all__ = ["CASES", "BenchConfig", "run"]
