"""``weightsync plan --topology FILE``: what the senders' planner would do on a described cluster.

The shell around :func:`weightsync.cluster.plan_cluster` (the same
:func:`weightsync.topology.plan_topology` the senders run): read the topology file (YAML or
JSON) and the model's config, plan, print the bytes per link class, the busiest NIC and NVLink,
the predicted time, the floor and what bounds each; then what the multi-host runtime as built
would take for the same cluster (:func:`weightsync.cluster.runtime_estimate`: its senders send
each engine TP rank group its slices, from one GPU per trainer host, without the relaying
between engine hosts this plan does).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from weightsync.app import output
from weightsync.cluster import GB, RuntimeEstimate, Topology, cluster, plan_built, runtime_estimate
from weightsync.errors import ConfigError
from weightsync.model_shapes import MODEL_TYPES, PRESETS, model_tensors, total_params
from weightsync.topology import TopologyPlan

EPILOG = """\
The topology file (YAML or JSON; unknown keys are errors):

  model:    preset: {presets}
            or config: path/to/config.json (relative to the file), its model_type one of
            {types}
  trainer:  hosts, gpus_per_host, tp, pp, ep, expert_tp (default 1), dp (optional, checked:
            hosts*gpus_per_host/(tp*pp)), pp_layers (optional: decoder layers per stage).
            Megatron rank order (tp-cp-ep-dp-pp), hosts filled in rank order; TP within a host.
  engines:  replicas, tp (GPUs per replica), ep (divides tp; vLLM's EP is ep = tp),
            gpus_per_host, dtype: bf16 | fp8 (1 byte per linear weight + 128x128 block scales)
  links:    nic_gb_s (per GPU, per direction; default 50), nvlink_gb_s (350), hbm_gb_s (2000),
            host_nic_gb_s (all of a host's NICs; default: unbounded)
  transfer: broadcast (one send per slice, receivers relay; default) | p2p (one read per receiver)

predicted: the plan's busiest link, bytes over rate (every link runs at once). floor: the least
any assignment of the same bytes to nearest copies can take in this link model, and what bounds
it. Exit 0, or 2 with one line naming the field of a bad file.
"""


DELTA_ENCODE_GB_S = 370.0
"""A sender's delta encoding rate on an H200 with the delta kernels: 14 layers of the 7B shape
(8.71 GB) in 256 MiB buckets, an Adam step at lr 1e-6, encoded in 22.6-23.4 ms, 372-385 GB/s,
its copy into the kept bases included (docs/benchmarks.md, 2026-11-29). Smaller buckets encode
slower (a 32 MiB bucket at about 140 GB/s: a sync and launches per bucket)."""


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG.format(presets=" | ".join(PRESETS), types=", ".join(MODEL_TYPES))
    p.add_argument("--topology", required=True, metavar="FILE", help="the cluster (YAML or JSON)")
    p.add_argument(
        "--delta-ratio",
        type=float,
        metavar="R",
        help="also print the times of a version sent as exact deltas of R times its bytes "
        "(0 < R <= 1; python -m weightsync.app.bench.deltas measures R, --fp8 for FP8 engines)",
    )
    p.add_argument(
        "--delta-encode-gb-s",
        type=float,
        metavar="E",
        help="with --delta-ratio: how fast a sender encodes its buckets as deltas, GB of "
        f"bucket per second (default {DELTA_ENCODE_GB_S:g}: measured on an H200, "
        "docs/benchmarks.md); each sender encodes every byte it would send",
    )


def load_topology(path: Path) -> tuple[Topology, dict[str, Any]]:
    """The topology file and its model's HF config.

    Raises:
        ConfigError: unreadable or malformed file, an invalid field (named), an unknown preset,
        an unreadable config.json.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"topology file {str(path)!r}: {e.strerror}") from None
    raw = _parse(path, text)
    try:
        topo = Topology.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"topology file {str(path)!r}: {describe(e)}") from None
    spec = topo.model
    if spec.preset is not None:
        if spec.preset not in PRESETS:
            raise ConfigError(
                f"topology file {str(path)!r}: model.preset={spec.preset!r} is unknown; "
                f"known: {', '.join(PRESETS)}"
            )
        return topo, PRESETS[spec.preset]
    config_path = path.parent / str(spec.config)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"topology file {str(path)!r}: model.config {str(config_path)!r}: {e}"
        ) from None
    return topo, config


def _parse(path: Path, text: str) -> Any:
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"topology file {str(path)!r}: reading YAML needs PyYAML (pip install pyyaml); "
                "or give the same fields as JSON"
            ) from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"topology file {str(path)!r}: not YAML: {e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigError(f"topology file {str(path)!r}: not JSON: {e}") from None


def describe(error: ValidationError) -> str:
    """One line naming every invalid field by its dotted path, its value and the problem."""
    parts = []
    for item in error.errors():
        where = ".".join(str(x) for x in item["loc"]) or "(top level)"
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            parts.append(f"{where}: unknown field")
        elif item["type"] == "missing":
            parts.append(f"{where}: missing")
        elif item["type"].startswith("model_") or item["type"] == "value_error":
            parts.append(f"{where or 'file'}: {msg}")
        else:
            parts.append(f"{where}={item.get('input')!r}: {msg}")
    return "; ".join(parts)


def run_plan(args: argparse.Namespace) -> int:
    path = Path(args.topology)
    topo, config = load_topology(path)
    ratio = args.delta_ratio
    if ratio is not None and not 0 < ratio <= 1:
        raise ConfigError(f"--delta-ratio {ratio:g}: a delta is 0 < R <= 1 of the bytes")
    encode = args.delta_encode_gb_s
    if encode is not None and ratio is None:
        raise ConfigError("--delta-encode-gb-s times the encoding of deltas: give --delta-ratio")
    encode = DELTA_ENCODE_GB_S if encode is None else encode
    if not encode > 0:
        raise ConfigError(f"--delta-encode-gb-s {encode:g}: a rate is > 0")
    built = cluster(topo, config)  # once: for a 1T model it is most of the run
    plan, run = plan_built(topo, built), runtime_estimate(topo, built)
    print_plan(path, topo, config, plan, run)
    if ratio is not None:
        print(_with_deltas(ratio, plan, run, encode * GB), flush=True)
    return 0


def _with_deltas(
    ratio: float, plan: TopologyPlan, run: RuntimeEstimate, encode_bytes_per_s: float
) -> str:
    """The same plan with every slice ``ratio`` of its bytes (every time here is bytes over a
    link's rate, so each scales by ``ratio``), and what the wire then no longer hides: each
    sender encodes every byte of its part's buckets (both versions read), at
    ``encode_bytes_per_s``, while earlier buckets cross; the busiest sender's encoding bounds
    the version where it takes longer than the wire."""
    host, sent = run.busiest_part
    encode_s = sent / encode_bytes_per_s
    wire_s = run.predicted_s * ratio
    bound = "the senders' encoding" if encode_s > wire_s else "the wire"
    return (
        f"with deltas of {ratio:g}x the bytes: on the wire predicted {plan.predicted_s * ratio:.3f}"
        f" s, floor {plan.floor_s * ratio:.3f} s, as built {wire_s:.3f} s; encoding them, "
        f"{_gb(sent)} GB at {encode_bytes_per_s / GB:g} GB/s on {host}: {encode_s:.3f} s; a "
        f"version as built about {max(wire_s, encode_s):.3f} s, bound by {bound} (a receiver "
        "that missed a version, or joined late, takes the full bytes)"
    )


def _gb(n: float) -> str:
    return f"{n / GB:,.2f}"


def print_plan(
    path: Path,
    topo: Topology,
    config: dict[str, Any],
    plan: TopologyPlan,
    run: RuntimeEstimate,
) -> None:
    t, e = topo.trainer, topo.engines
    tensors = model_tensors(config, fp8=e.dtype == "fp8")
    model = topo.model.preset or topo.model.config
    console = output.console()
    print(
        f"weightsync plan {path}: {model} ({total_params(tensors) / 1e9:,.1f}B params, "
        f"{_gb(sum(x.nbytes for x in tensors))} GB as {e.dtype})\n"
        f"  trainer {t.hosts} hosts x {t.gpus_per_host} GPUs: TP={t.tp} PP={t.pp} EP={t.ep} "
        f"expert TP={t.expert_tp} DP={t.hosts * t.gpus_per_host // (t.tp * t.pp)}\n"
        f"  engines {e.replicas} replicas x {e.tp} GPUs (TP={e.tp} EP={e.ep}), "
        f"{e.gpus_per_host} per host; {topo.transfer}; NIC {topo.links.nic_gb_s:g} GB/s per GPU",
    )
    by_kind: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for link, n in plan.link_bytes.items():
        by_kind[link.kind].append((n, link.where))
    table = output.table(
        "link class", "links", "total GB", "busiest", "busiest GB", "busiest s",
        title="bytes per link class", right=("links", "total GB", "busiest GB", "busiest s"),
    )  # fmt: skip
    for kind, loads in by_kind.items():
        n, where = min(loads, key=lambda x: (-x[0], x[1]))  # ties: as busiest() names them
        rate = plan.rates.rate(kind)  # type: ignore[arg-type]
        output.add_row(
            table, kind, len(loads), _gb(sum(x for x, _ in loads)), where, _gb(n),
            f"{n / rate:.3f}" if rate != math.inf else "unbounded",
        )  # fmt: skip
    console.print(table)
    console.file.flush()
    routes = ", ".join(f"{r} {_gb(n)} GB" for r, n in plan.route_bytes.items())
    nics = [(n / plan.rates.rate(link.kind), link) for link, n in plan.link_bytes.items()
            if link.kind in ("nic_out", "nic_in")]  # fmt: skip
    nic_s, nic = min(nics, default=(0.0, None), key=lambda x: (-x[0], x[1]))
    ratio = plan.predicted_s / plan.floor_s if plan.floor_s else 1.0
    lines = [
        f"bytes taken by route: {routes}",
        f"busiest NIC: {nic or 'none'}, {nic_s:.3f} s",
        f"predicted: {plan.predicted_s:.3f} s, bound by {plan.bottleneck or 'nothing'}",
        f"floor: {plan.floor_s:.3f} s, bound by {plan.floor_bound}",
        f"ratio: {ratio:.2f}x the floor",
        f"as built: {_as_built(run, plan.floor_s)}",
    ]
    print("\n".join(lines), flush=True)  # plain lines: never wrapped, whatever the width


def _as_built(run: RuntimeEstimate, floor_s: float) -> str:
    """The runtime's cost today, beside the plan."""
    host, sent = run.busiest_part
    ratio = f" ({run.predicted_s / floor_s:.2f}x the floor)" if floor_s else ""
    return (
        f"{len(run.parts.hosts)} sender(s), one per trainer host, each broadcasting its part's "
        f"slices to every group of engine ranks keeping the same ones (most sent: "
        f"{_gb(sent)} GB, {host}; most taken by an engine GPU: {_gb(run.taken)} GB): "
        f"{run.predicted_s:.3f} s, bound by {run.bound}{ratio}"
    )
