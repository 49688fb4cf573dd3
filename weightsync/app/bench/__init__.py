"""``weightsync bench``: sync time against the hardware floor and the peers' patterns.

Synthetic trainer shards with real model shapes (:mod:`.models`, :mod:`.layout`), an
engine-like receiver target (:mod:`.engine_like`), floors (:mod:`.floors`), peer baselines
(:mod:`.baselines`), the run (:mod:`.runner`) and its report (:mod:`.report`).
"""

from weightsync.app.bench.runner import CASES, BenchConfig, run

__all__ = ["CASES", "BenchConfig", "run"]
