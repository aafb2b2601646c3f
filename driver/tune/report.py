"""`ggufc tune --report DIR`: what a tuning database holds, as a table and a plot.

The table has one row per workload: default and tuned time (both timed by ggufc on the same data,
in interleaved rounds), the speedup, trials and whether `ggufc compile --tuning-db` would use the
tuned schedule, and which devices measured its records (the table's last column; a summary per
device follows). The plot shows MetaSchedule's best measured time against trials for each workload,
with the default schedule's time as a dashed line of the same colour.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .database import TuningDB
from .options import TuneError


@dataclass(frozen=True)
class Row:
    hash: str
    label: str
    target: str
    models: dict[str, int]
    trials: int
    default_us: float | None
    tuned_us: float | None
    ms_best_us: float | None
    exhausted: bool
    devices: dict[str, int]  # device -> records it measured
    timed_on: str | None  # where ggufc's paired default/tuned timing ran
    knobs: dict[str, int] | None = None  # a hand-written kernel's best knob settings
    timing: str = "hot"  # how the paired times were measured (cold: arguments flushed from the caches)

    @property
    def measured_on(self) -> str:
        if not self.devices:
            return "-"
        if len(self.devices) == 1:
            return next(iter(self.devices))
        return f"{len(self.devices)} devices"

    @property
    def calls(self) -> int:
        return max(self.models.values(), default=0)

    @property
    def speedup(self) -> float | None:
        if self.default_us and self.tuned_us:
            return self.default_us / self.tuned_us
        return None

    def status(self, min_speedup: float = 1.0) -> str:
        if not self.trials:
            return "untuned"
        s = self.speedup
        if s is None:
            return "no valid record"
        return "tuned" if s >= min_speedup else "default kept"


def rows(db: TuningDB) -> list[Row]:
    """Every workload, heaviest first (calls per decode step x default time)."""
    out = []
    for h, e in db.workloads.items():
        target = e.get("target") or {}
        devices: dict[str, int] = {}
        for d in db.devices(h):
            devices[d] = devices.get(d, 0) + 1
        out.append(Row(h, str(e.get("label", e.get("kind", "?"))),
                       f"{target.get('kind', '?')}" + (f"/{target['mcpu']}" if target.get("mcpu") else ""),
                       dict(e.get("models") or {}), len(db.records(h)), e.get("default_us"), e.get("tuned_us"),
                       e.get("ms_best_us"), bool(e.get("exhausted")), devices, e.get("timed_on"), e.get("knobs"),
                       str(e.get("timing", "hot"))))
    return sorted(out, key=lambda r: (-(r.calls * (r.default_us or 0.0)), r.hash))


def table(db: TuningDB, min_speedup: float = 1.0) -> str:
    rs = rows(db)
    if not rs:
        return f"{db.root}: no workloads yet"
    header = (f"{'workload':<16}  {'kernel':<36} {'calls':>5} {'trials':>6} {'default us':>11} {'tuned us':>10} "
              f"{'speedup':>8} {'timing':<6}  {'status':<14} measured on")
    lines = [header, "-" * len(header)]
    for r in rs:
        tuned = f"{r.tuned_us:10.2f}" if r.tuned_us else f"{'-':>10}"
        default = f"{r.default_us:11.2f}" if r.default_us else f"{'-':>11}"
        speed = f"{r.speedup:7.2f}x" if r.speedup else f"{'-':>8}"
        status = r.status(min_speedup) + (" (search exhausted)" if r.exhausted else "")
        lines.append(f"{r.hash:<16}  {r.label[:36]:<36} {r.calls:>5} {r.trials:>6} {default} {tuned} {speed} "
                     f"{r.timing:<6}  {status:<14} {r.measured_on}")
    lines.append("")
    lines += _per_model(rs, min_speedup)
    knobbed = [r for r in rs if r.knobs]
    if knobbed:
        lines.append("")
        lines.append("best knob settings of the hand-written kernels (bit-identical results):")
        lines += [f"  {r.hash}  {r.label[:36]:<36} " + " ".join(f"{k}={v}" for k, v in sorted(r.knobs.items()))
                  for r in knobbed if r.knobs]
    lines.append("")
    lines += _per_device(rs)
    lines.append("")
    lines.append("calls: per decode step (largest over the models using the workload); times: ggufc's median of "
                 "interleaved runs on the same data, cold: each call after its weights were flushed from the caches")
    return "\n".join(lines)


def _per_model(rs: list[Row], min_speedup: float) -> list[str]:
    """Per model: the tunable kernels' time in one decode step, default vs with the database."""
    models = sorted({m for r in rs for m in r.models})
    out = [f"per decode step, summed over the tunable kernels (rope, cache writes excluded; attention as timed "
           f"at its timing position), tuned schedules used where >= {min_speedup:.2f}x:"]
    for m in models:
        default = tuned = 0.0
        n = used = 0
        for r in rs:
            calls = r.models.get(m)
            if not calls or not r.default_us:
                continue
            n += 1
            default += calls * r.default_us
            use = r.status(min_speedup) == "tuned"
            used += use
            tuned += calls * (r.tuned_us if use and r.tuned_us else r.default_us)
        ratio = f"{default / tuned:.3f}x" if tuned else "-"
        out.append(f"  {m}: {n} workloads, {used} tuned: {default / 1000:.3f} ms -> {tuned / 1000:.3f} ms ({ratio})")
    return out


def _per_device(rs: list[Row]) -> list[str]:
    """Records per measuring device, and where ggufc's paired timings ran."""
    records: dict[str, int] = {}
    timings: dict[str, int] = {}
    for r in rs:
        for d, n in r.devices.items():
            records[d] = records.get(d, 0) + n
        if r.timed_on:
            timings[r.timed_on] = timings.get(r.timed_on, 0) + 1
    out = ["records per measuring device:"]
    out += [f"  {d}: {n} records" for d, n in sorted(records.items())] or ["  none yet"]
    if timings:
        out.append("default/tuned timings ran on: " + ", ".join(f"{d} ({n} workloads)"
                                                               for d, n in sorted(timings.items())))
    return out


def plot(db: TuningDB, path: str | os.PathLike[str], top: int = 12) -> Path:
    """Best time against trials for the `top` heaviest tuned workloads, written as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise TuneError("the plot needs matplotlib: pip install matplotlib (or pip install 'ggufc[dev]')") from None
    rs = [r for r in rows(db) if db.history(r.hash)][:top]
    fig, ax = plt.subplots(figsize=(10, 6), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(rs):
        color = colors[i % len(colors)]
        hist = db.history(r.hash)
        xs = [t for t, _ in hist]
        ys = [s * 1e6 for _, s in hist]
        ax.step(xs, ys, where="post", color=color, label=f"{r.label[:40]} (x{r.calls})")
        ax.plot(xs[-1:], ys[-1:], "o", color=color, markersize=4)
        if r.default_us:
            ax.axhline(r.default_us, color=color, linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("trials (measured candidates)")
    ax.set_ylabel("best time so far (us, MetaSchedule runner)")
    ax.set_title(f"ggufc tune: {db.root.name} — dashed: default schedule")
    if rs:
        ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, which="both", alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def report(db_dir: str | os.PathLike[str], plot_path: str | os.PathLike[str] | None = None,
           min_speedup: float = 1.0) -> tuple[str, Path]:
    """(the table, where the plot was written); the plot defaults to DIR/report.png."""
    db = TuningDB(db_dir)
    text = table(db, min_speedup)
    out = plot(db, plot_path if plot_path is not None else db.root / "report.png")
    return text, out


def summary(db_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Machine-readable rows (for scripts and tests)."""
    db = TuningDB(db_dir)
    return {r.hash: {"label": r.label, "models": r.models, "trials": r.trials, "default_us": r.default_us,
                     "tuned_us": r.tuned_us, "speedup": r.speedup, "status": r.status(), "devices": r.devices,
                     "timed_on": r.timed_on, "knobs": r.knobs} for r in rows(db)}
