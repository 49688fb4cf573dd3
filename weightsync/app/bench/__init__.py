"""``weightsync bench``: sync time against the hardware floor and the peers' patterns.

Synthetic trainer shards with real model shapes (:mod:`.models`, :mod:`.layout`), an
engine-like receiver target (:mod:`.engine_like`), floors (:mod:`.floors`), peer baselines
(:mod:`.baselines`), the settings (:mod:`.config`), the run (:mod:`.runner`), each weightsync
case (:mod:`.cases`) and the report (:mod:`.report`).

The package imports none of them: ``python -m weightsync.app.bench.fp8`` (and the other benches
run alone) would otherwise find its module imported before it runs.
"""
