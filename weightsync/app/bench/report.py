"""Bench results: one row per measured case, the table, the JSON and the plot."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from rich.table import Table

from weightsync.app.bench.models import MODELS

FLOOR, BASELINE, WEIGHTSYNC = "floor", "baseline", "weightsync"
SAME, OTHER = "same GPU", "other GPU"
PER_TENSOR, LOCKSTEP, D2D = "per-tensor IPC", "lockstep bucket", "d2d copy"
FLAT = "flat copy"
"""Floor: one copy of the trainer's whole flat buffer on its GPU (no per-tensor launches)."""
NODE_FLOOR = "every GPU its share"
"""The node case's floor: every GPU copying its share from its own memory at once."""
NODE_LINK_FLOOR = "interconnect floor"
"""The node case's floor with the links (issue 32): the larger of every GPU its share and the
peer bytes into the busiest GPU over the best peer bandwidth measured in the same run."""
MEGATRON = "megatron"
"""The node case's row with a real megatron-core trainer (issue 32), beside the synthetic
trainer's ``direct`` row of the same layout and held to the same floors."""
HOSTS_FLOOR = "one broadcast"
"""The hosts case's floor: one broadcast of the model's bytes between two GPUs; the fan-out
case's too, from GPU 0 to its other GPUs (its rows' placement starts with "fan-out")."""
GB = 1e9


@dataclass(frozen=True)
class Row:
    """One measured (or skipped, or failed) case."""

    kind: str
    """floor, baseline or weightsync."""
    name: str
    """What ran: ``d2d copy``, ``broadcast``, a baseline's name, ``staged`` or ``direct``."""
    transport: str
    layout: str
    placement: str
    """Where the receiver is relative to the trainer: same GPU, other GPU, or cpu."""
    nbytes: int
    samples_s: tuple[float, ...] = ()
    """Seconds of every measured version (warm-up excluded); empty when skipped or failed."""
    trainer_extra_bytes: int | None = None
    """Peak extra ``torch.cuda.max_memory_allocated`` in the trainer+sender process."""
    receiver_extra_bytes: int | None = None
    """Peak extra ``torch.cuda.max_memory_allocated`` in the receiver process."""
    bit_exact: bool | None = None
    """Receiver's packed params equal the trainer's tensors after the last version."""
    note: str = ""
    failed: bool = False
    written_buckets: tuple[int, ...] = ()
    """Of every measured version, the staged buckets the sender wrote into the receiver's
    weights itself (its status' ``ReceiverOutcome.written_buckets``); the receiver loaded the
    rest. Empty where nothing was written."""

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.samples_s) if self.samples_s else None

    @property
    def gb_per_s(self) -> float | None:
        s = self.seconds
        return self.nbytes / s / GB if s else None


@dataclass
class Report:
    meta: dict
    rows: list[Row] = field(default_factory=list)

    def _find(
        self, kind: str, name: str, placement: str | None = None, layout: str | None = None
    ) -> float | None:
        for r in self.rows:
            if r.kind == kind and r.name == name and (placement in (None, r.placement)):
                if r.seconds and layout in (None, r.layout):
                    return r.seconds
        return None

    def floor_for(self, row: Row) -> float | None:
        """The floor a row is held against: the broadcast across GPUs, else the D2D copy."""
        if row.placement == OTHER:
            return self._find(FLOOR, "broadcast")
        if row.placement.startswith("node"):  # measured in the same run, for this layout
            link = self._find(FLOOR, NODE_LINK_FLOOR, row.placement, row.layout)
            return link or self._find(FLOOR, NODE_FLOOR, row.placement, row.layout)
        if row.placement.startswith(("2 hosts", "fan-out")):
            return self._find(FLOOR, HOSTS_FLOOR, row.placement)
        return self._find(FLOOR, D2D)

    def ratios(self, row: Row) -> dict[str, float | None]:
        """x floor (seconds / floor; lower is better) and speed-ups over the two baselines
        (baseline seconds / seconds; higher is better), None where not comparable."""
        s = row.seconds
        floor = self.floor_for(row) if row.kind != FLOOR else None
        colocated = row.kind == WEIGHTSYNC and row.placement != OTHER
        per_tensor, lockstep = self._find(BASELINE, PER_TENSOR), self._find(BASELINE, LOCKSTEP)
        return {
            "x_floor": s / floor if s and floor else None,
            "x_per_tensor": per_tensor / s if s and per_tensor and colocated else None,
            "x_lockstep": lockstep / s if s and lockstep and colocated else None,
        }

    def extra_memory(self, row: Row) -> dict[str, int]:
        """Peak extra bytes per device: trainer's and receiver's add up when they share it."""
        t, r = row.trainer_extra_bytes, row.receiver_extra_bytes
        if t is None and r is None:
            return {}
        if row.placement == OTHER:
            return {"trainer device": t or 0, "receiver device": r or 0}
        return {"trainer device": (t or 0) + (r or 0)}

    def _moe(self) -> bool:
        """Whether the run's model is MoE (runs saved before the meta said so: by its name)."""
        moe = self.meta.get("moe")
        if moe is None:
            shape = MODELS.get(self.meta.get("model", ""))
            moe = shape is not None and shape.is_moe
        return moe

    def targets(self) -> list[dict]:
        """The issue's targets, evaluated on this run's rows (met or not, reported as is)."""
        if not self.meta.get("gpus"):
            return []  # the targets are for H200s; CPU numbers are smoke tests only
        bucket = self.meta.get("bucket_size_bytes", 0)
        out = []

        def add(what: str, value: float | None, limit: float, at_most: bool) -> None:
            if value is not None:
                met = value <= limit if at_most else value >= limit
                out.append({"target": what, "value": round(value, 3), "limit": limit, "met": met})

        for r in self.rows:
            if r.kind != WEIGHTSYNC or not r.seconds:
                continue
            label = f"{r.name} {r.transport} {r.layout} ({r.placement})"
            where = (r.placement, r.layout)
            x = self.ratios(r)
            if r.placement.startswith("node"):
                add(f"{label}: x interconnect floor (issue 32)", x["x_floor"], 1.3, True)
            if r.name == MEGATRON and (synthetic := self._find(WEIGHTSYNC, "direct", *where)):
                add(
                    f"{label}: x the synthetic trainer (issue 32)", r.seconds / synthetic, 1.1, True
                )
            if r.name == "direct" and r.layout == "TP=1":
                add(f"{label}: x floor", x["x_floor"], 1.4, True)
            if r.name == "staged" and r.layout == "TP=2" and r.placement == SAME:
                add(f"{label}: x floor", x["x_floor"], 2.3, True)
            if r.placement.startswith("fan-out"):
                add(f"{label}: x one broadcast (issue 32)", x["x_floor"], 1.2, True)
            elif r.transport == "nccl":
                add(f"{label}: x broadcast floor", x["x_floor"], 1.3, True)
                add(f"{label}: x broadcast floor (issue 11)", x["x_floor"], 1.15, True)
            flat = self._find(FLOOR, FLAT)
            if r.placement == SAME and flat:
                # Issue 11: one GPU within 1.3x one flat copy (dense), 2x (MoE).
                limit = 2.0 if self._moe() else 1.3
                add(f"{label}: x one flat copy (issue 11)", r.seconds / flat, limit, True)
                # Issue 32, dense and MoE alike: direct within 1.25x one flat copy; staged
                # (two passes, trainer -> bucket -> weights) within 1.3x two.
                if r.name == "direct":
                    add(f"{label}: x one flat copy (issue 32)", r.seconds / flat, 1.25, True)
                elif r.name == "staged":
                    add(f"{label}: x two flat copies (issue 32)", r.seconds / flat / 2, 1.3, True)
            add(f"{label}: speed-up over per-tensor IPC", x["x_per_tensor"], 4.0, False)
            add(f"{label}: speed-up over lockstep bucket", x["x_lockstep"], 2.5, False)
            if bucket:
                for device, extra in self.extra_memory(r).items():
                    add(f"{label}: extra GB on {device}", extra / GB, 2 * bucket * 1.05 / GB, True)
        return out

    def table(self) -> Table:
        m = self.meta
        table = Table(
            title=f"weightsync bench: {m['model']} ({m['model_note']}), {m['tensors']} tensors, "
            f"{m['gb']:.2f} GB, median of {m['versions']} versions after {m['warmup']} warm-up"
            + (f", CUDA MPS {m['mps']}" if m.get("mps", "off") != "off" else "")
            + (f", {m['awake_cpus']} CPUs kept awake" if m.get("awake_cpus") else ""),
            caption="x floor = seconds / floor (D2D copy same device, broadcast across GPUs, "
            "for the node the larger of every GPU copying its share at once and the busiest "
            "GPU's peer bytes over the best peer bandwidth); "
            "x per-tensor, x lockstep = baseline seconds / seconds (speed-up); extra memory = "
            "peak torch.cuda.max_memory_allocated delta, trainer+sender / receiver process",
        )
        for col in ("model", "case", "transport", "layout", "receiver", "GB", "seconds", "GB/s"):
            table.add_column(
                col,
                justify="right" if col in ("GB", "seconds", "GB/s") else "left",
                overflow="fold",  # wrap, never cut (see weightsync.app.output)
            )
        for col in ("x floor", "x per-tensor", "x lockstep", "extra mem GB", "bit-exact", "note"):
            table.add_column(col, justify="left" if col == "note" else "right", overflow="fold")

        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        for r in self.rows:
            x = self.ratios(r)
            mem = "-"
            if r.trainer_extra_bytes is not None or r.receiver_extra_bytes is not None:
                t, rcv = r.trainer_extra_bytes or 0, r.receiver_extra_bytes or 0
                mem = f"{t / GB:.2f}/{rcv / GB:.2f}"
            exact = "-" if r.bit_exact is None else ("yes" if r.bit_exact else "[red]NO[/red]")
            note = f"[red]{r.note}[/red]" if r.failed else r.note
            table.add_row(
                m["model"],
                r.name,
                r.transport,
                r.layout,
                r.placement,
                f"{r.nbytes / GB:.2f}",
                num(r.seconds, ".4f"),
                num(r.gb_per_s, ".1f"),
                num(x["x_floor"], ".2f"),
                num(x["x_per_tensor"], ".2f"),
                num(x["x_lockstep"], ".2f"),
                mem,
                exact,
                note,
            )
        return table

    def to_json(self) -> dict:
        rows = []
        for r in self.rows:
            rows.append(
                {
                    **asdict(r),
                    "seconds": r.seconds,
                    "gb_per_s": r.gb_per_s,
                    **self.ratios(r),
                    "extra_memory_bytes": self.extra_memory(r),
                }
            )
        return {"meta": self.meta, "rows": rows, "targets": self.targets()}

    @classmethod
    def from_json(cls, data: dict) -> Report:
        """The report a :meth:`to_json` wrote (derived columns are computed again)."""
        names = {f.name for f in fields(Row)}
        rows = [
            Row(
                **{k: v for k, v in r.items() if k in names}
                | {k: tuple(r.get(k, ())) for k in ("samples_s", "written_buckets")}
            )
            for r in data["rows"]
        ]
        return cls(data["meta"], rows)

    def write_json(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"bench-{self.meta['model']}.json"
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def plot(self, out_dir: Path) -> Path | str:
        """Draw seconds per case to a PNG; returns its path, or why it could not."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return "matplotlib is not installed here: no plot (pip install matplotlib)"
        rows = [r for r in self.rows if r.seconds]
        labels = [f"{r.name} {r.transport} {r.layout} {r.placement}" for r in rows]
        colors = {FLOOR: "tab:gray", BASELINE: "tab:orange", WEIGHTSYNC: "tab:blue"}
        fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.5))
        ms = [r.seconds * 1e3 for r in rows]
        bars = ax.barh(labels, ms, color=[colors[r.kind] for r in rows])
        ax.bar_label(bars, fmt="%.2f ms", padding=3)
        ax.set_xlim(0, max(ms) * 1.15)  # room for the last label
        ax.invert_yaxis()
        ax.set_xlabel("milliseconds per version (median; lower is better)")
        m = self.meta
        # Over the whole figure: above the axes alone, a long title runs off the right edge.
        fig.suptitle(f"{m['model']} ({m['model_note']}), {m['gb']:.2f} GB, {m['machine']}")
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"bench-{m['model']}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
