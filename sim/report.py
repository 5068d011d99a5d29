"""What ``tickwheel sim`` prints, and what ``--report DIR`` writes.

Owns the human summary (a rich table), the JSON object, and the report directory: the summary
as JSON and Markdown, and two plots of the first seed (lateness over time with the faults
marked; runs waiting for a worker through the burst). Must never run or judge a simulation.
matplotlib is imported only when a report is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.config import HOUR_MS
from sim.runner import Summary

if TYPE_CHECKING:
    from rich.console import Console

MINUTE = 60_000

_FAULT_COLOURS = {
    "crash": "#d62728",
    "crash-writing": "#d62728",
    "pause": "#9467bd",
    "worker-crash": "#ff7f0e",
    "slow-disk": "#8c564b",
}


def print_summary(summary: Summary, console: Console) -> None:
    from rich.table import Table  # rich only for a human summary, not for --json

    d = summary.to_dict()
    late = d["lateness_ms"]
    table = Table(title="tickwheel sim", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    seeds = f"{d['seeds']} (from {d['first_seed']})"
    if d["mutant"]:
        caught = d["caught_at_seed"]
        seeds += f", mutant {d['mutant']}: " + (
            f"caught at seed {caught}" if caught is not None else "NOT caught"
        )
    table.add_row("seeds", seeds)
    table.add_row(
        "cluster",
        f"{d['nodes']} nodes, {d['workers']} workers, {d['jobs']:,} jobs, {d['hours']} h, "
        f"faults: {', '.join(d['faults']) or 'none'}",
    )
    table.add_row("runs", f"{d['runs']:,} ({d['executions']:,} executions)")
    table.add_row(
        "lateness",
        f"p50 {_ms(late['p50'])}, p99 {_ms(late['p99'])}, max {_ms(late['max'])}",
    )
    table.add_row(
        "checks",
        f"missed {d['missed']}, double-executed {d['double_executed']}, early {d['early']}, "
        f"stuck {d['stuck']}, violations {len(d['violations'])}",
    )
    table.add_row("trace_hash", d["trace_hash"])
    per_seed = d["seconds_per_seed"]
    table.add_row(
        "time",
        f"{d['elapsed_s']:.1f} s (per seed: mean {per_seed['mean']} s, max {per_seed['max']} s)",
    )
    console.print(table)
    shown: set[int] = set()
    for v in d["violations"][:20]:
        console.print(f"[bold red]seed {v['seed']}[/] {v['check']}: {v['message']}")
        if v["seed"] not in shown and v["trace"]:
            shown.add(v["seed"])
            console.print(f"  trace excerpt (re-run of seed {v['seed']}):", style="dim")
            for line in v["trace"]:
                console.print(f"    {line}", style="dim", markup=False, highlight=False)
    if len(d["violations"]) > 20:
        console.print(f"... and {len(d['violations']) - 20} more violations")


def _ms(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value:,} ms" if abs(value) < 10_000 else f"{value / 1000:,.1f} s"


def to_json(summary: Summary) -> str:
    return json.dumps(summary.to_dict(), indent=2, sort_keys=False)


# ------------------------------------------------------------------------ the report


def write_report(summary: Summary, directory: Path) -> list[Path]:
    """Write ``summary.json``, ``summary.md``, ``lateness.png`` and ``ready_queue.png``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "summary.json", directory / "summary.md"]
    written[0].write_text(to_json(summary) + "\n")
    written[1].write_text(_markdown(summary.to_dict()))
    first = summary.first
    if first is not None:
        import matplotlib

        matplotlib.use("Agg")
        written.append(_plot_lateness(first.lateness, first.faults, directory))
        written.append(_plot_queue(first.queue, first.faults, first.burst_at, directory))
    return written


def _markdown(d: dict[str, Any]) -> str:
    late = d["lateness_ms"]
    lines = [
        "# tickwheel sim",
        "",
        f"- seeds: {d['seeds']} from {d['first_seed']}; mutant: {d['mutant'] or 'none'}"
        + (f", caught at seed {d['caught_at_seed']}" if d["caught_at_seed"] is not None else ""),
        f"- cluster: {d['nodes']} nodes, {d['workers']} workers, {d['jobs']} jobs, "
        f"{d['hours']} h; faults: {', '.join(d['faults']) or 'none'}",
        f"- runs: {d['runs']} ({d['executions']} executions)",
        f"- lateness (first executions): p50 {late['p50']} ms, p99 {late['p99']} ms, "
        f"max {late['max']} ms",
        f"- missed {d['missed']}, double-executed {d['double_executed']}, early {d['early']}, "
        f"stuck {d['stuck']}",
        f"- trace_hash (first seed): `{d['trace_hash']}`",
        f"- time: {d['elapsed_s']} s",
        "",
        f"## Violations ({len(d['violations'])})",
        "",
    ]
    for v in d["violations"]:
        lines.append(f"- seed {v['seed']}, {v['check']}: {v['message']}")
        if v["trace"]:
            lines += ["", "```", *v["trace"], "```", ""]
    if not d["violations"]:
        lines.append("None: every check held.")
    lines += ["", "Plots (first seed): `lateness.png`, `ready_queue.png`.", ""]
    return "\n".join(lines)


def _mark_faults(ax: Any, faults: list[tuple[int, int, str, str]]) -> None:
    seen: set[str] = set()
    for start, end, kind, target in faults:
        family = kind.split("-")[0] if kind.startswith(("skew", "partition")) else kind
        colour = _FAULT_COLOURS.get(kind, "#2ca02c" if family == "skew" else "#1f77b4")
        label = family if family not in seen else None
        seen.add(family)
        ax.axvspan(start / MINUTE, max(end, start + 1_000) / MINUTE, color=colour, alpha=0.12)
        ax.axvline(start / MINUTE, color=colour, alpha=0.6, linewidth=0.8, label=label)
        del target


def _plot_lateness(
    lateness: list[tuple[int, int]], faults: list[tuple[int, int, str, str]], directory: Path
) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    if lateness:
        xs = [t / MINUTE for t, _late in lateness]
        ys = [late for _t, late in lateness]
        ax.scatter(xs, ys, s=3, color="black", alpha=0.5, label="run started (first execution)")
    _mark_faults(ax, faults)
    ax.set_yscale("symlog", linthresh=10)  # linear within 10 ms of on time, log beyond
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("simulated minutes")
    ax.set_ylabel("start - scheduled time (ms, symlog)")
    ax.set_title("Lateness of every run over time, faults marked (first seed)")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    path = directory / "lateness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_queue(
    queue: list[tuple[int, int]],
    faults: list[tuple[int, int, str, str]],
    burst_at: int | None,
    directory: Path,
) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    if burst_at is not None:
        lo, hi = burst_at - 5 * MINUTE, burst_at + 30 * MINUTE
        title = "Runs waiting for a worker through the top-of-hour burst (first seed)"
    else:
        lo, hi = 0, (queue[-1][0] if queue else HOUR_MS)
        title = "Runs waiting for a worker (first seed; no burst fault in this run)"
    points = [(t, n) for t, n in queue if lo <= t <= hi]
    if points:
        ax.plot([t / MINUTE for t, _n in points], [n for _t, n in points], color="black")
    _mark_faults(ax, [f for f in faults if f[1] >= lo and f[0] <= hi])
    if burst_at is not None:
        ax.axvline(burst_at / MINUTE, color="red", linestyle="--", label="burst due")
    ax.set_xlim(lo / MINUTE, hi / MINUTE)
    ax.set_xlabel("simulated minutes")
    ax.set_ylabel("runs PENDING (durable), all shards")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    path = directory / "ready_queue.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
