"""What greenctl prints: tables, the status view, the jobs list, a job's report and its plot."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

__all__ = [
    "cap_notes",
    "fixed_point",
    "fmt",
    "plot_report",
    "render_jobs",
    "render_report",
    "render_status",
    "render_table",
    "render_whole_job",
]


def fmt(v: Any, digits: int = 1) -> str:
    """A cell: "-" for None, floats to ``digits`` places, or to two significant digits
    where those places would round a small figure to 0 (0.038 GFLOPS/W stays 0.038)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and math.isfinite(v) and abs(v) < 10.0**-digits:
            digits = min(12, 1 - math.floor(math.log10(abs(v))))
        return f"{v:.{digits}f}"
    return str(v)


def render_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    for r in cells:
        lines.append("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return s == "-"


def render_status(st: dict[str, Any]) -> str:
    out = [
        f"greend {st['version']} on {st['host']}  pid {st['pid']}  up {st['uptime_s']:.1f} s  "
        f"{st['hz']:g} Hz  ticks {st['ticks']} (skipped {st['ticks_skipped']})"
        + ("  DRY RUN" if st.get("dry_run") else ""),
        "",
    ]
    if st.get("tick_errors"):
        out[1:1] = [f"{st['tick_errors']} tick(s) failed; the last: {st.get('last_tick_error')} (see the daemon's log)"]
    if st["gpus"]:
        out.append(
            render_table(
                ["GPU", "NAME", "SOURCE", "POWER_W", "ENERGY_J", "SM_MHZ", "CAP_MHZ", "LIMIT_W", "METHOD"],
                [
                    [
                        g["index"],
                        g["name"],
                        g["source"],
                        g["power_w"],
                        g["energy_j"],
                        g["sm_clock_mhz"],
                        g["clock_cap_mhz"],
                        g["power_limit_w"],
                        g.get("energy_method"),
                    ]
                    for g in st["gpus"]
                ],
            )
        )
        if st.get("dry_run"):
            out.append("DRY RUN: CAP_MHZ and LIMIT_W are what greend recorded; the devices were not touched")
        for g in st["gpus"]:
            for knob, m in (g.get("cap_mismatch") or {}).items():
                out.append(f"gpu{g['index']} {knob}: asked {m['asked']:g}, the GPU holds {m['held']:g} (shown above)")
            for knob, r in (g.get("refused_knobs") or {}).items():
                out.append(f"gpu{g['index']} {knob}: refused ({r['reason']}), not tried again: {r['message']}")
    gp = st.get("gpu_probe")
    if gp and gp.get("state") == "initialising":
        out.append(f"GPUs: initialising ({gp['probe']}): {gp.get('detail')}")
    elif gp:
        for row in gp.get("gpus") or []:
            if row["state"] != "ok":
                out.append(f"gpu{row['index']}: {row['state'].upper()} ({row.get('detail')})")
    if not st["gpus"] and not (gp and gp.get("state") == "initialising"):
        out.append("no GPUs (see: greenctl probes)")
    out.append("")
    if st["cpus"]:
        out.append(
            render_table(
                ["ZONE", "PATH", "SOURCE", "POWER_W", "ENERGY_J", "COUNTED"],
                [
                    [
                        c["zone"],
                        c["path"],
                        c["source"],
                        c["power_w"],
                        c["energy_j"],
                        "yes" if c["counted"] else f"no (in {c['parent'] or 'platform'})",
                    ]
                    for c in st["cpus"]
                ],
            )
        )
    else:
        out.append("no CPU energy zones (see: greenctl probes)")
    t = st["totals"]
    out += ["", f"energy since start: GPUs {t['gpu_energy_j']:.1f} J, CPU {t['cpu_energy_j']:.1f} J"]
    pol = st.get("policy") or {}
    prec = (pol.get("precision") or {}).get("name")
    out.append(
        f"policy: {pol.get('name', 'none')}" + (f" + {prec}" if prec else "") + f"   jobs: {len(st.get('jobs') or [])}"
    )
    last = pol.get("last_decision") or {}
    if last.get("reason"):
        out.append(f"  last decision: {last['reason']}")
    if pol.get("disabled"):
        out.append(f"  {pol['disabled']}")
    for owner, knobs in (pol.get("owners") or {}).items():
        out.append(f"  set by {owner}: {', '.join(knobs)}")
    for s in st.get("stores", []):
        state = "ok" if s.get("ok") else f"FAILING: {s.get('last_error')}"
        rejected = s.get("rejected") or 0  # (points the server refused as malformed, set aside)
        out.append(
            f"store {s['url']}: {state} (written {s.get('written', 0)}, pending {s.get('pending', 0)},"
            f" dropped {s.get('dropped', 0)}" + (f", rejected {rejected}" if rejected else "") + ")"
        )
        if rejected and s.get("last_rejected"):
            out.append(f"  last rejected: {s['last_rejected']}")
    return "\n".join(out)


def _num(v: Any, spec: str = ".3g", unit: str = "") -> str:
    """``v`` as ``spec`` says; a fixed-point spec keeps two significant digits of a small
    figure (0.00015 GFLOPS/W, not 0.000: see :func:`fmt`)."""
    if v is None:
        return "-"
    text = fmt(float(v), int(spec[1:-1])) if fixed_point(spec) and isinstance(v, (int, float)) else f"{v:{spec}}"
    return f"{text}{(' ' + unit) if unit else ''}"


def fixed_point(spec: str) -> bool:
    """Whether ``spec`` is a plain fixed-point spec (".3f")."""
    return spec.startswith(".") and spec.endswith("f") and spec[1:-1].isdigit()


def render_report(r: dict[str, Any]) -> str:
    sim = r.get("gpu_source") == "sim"
    label = " (sim)" if sim else ""
    no_cpu = r.get("cpu_energy_method") == "unmeasured"
    lines = [
        f"job {r['job']}  [{r['state']}{', ' + r['end_reason'] if r.get('end_reason') else ''}]  "
        f"host {r.get('host')}  GPUs {r.get('gpus') if r.get('gpus') is not None else '-'}{label}"
        + (f"  run {r['run_id']}" if r.get("run_id") else ""),
        (
            "  steps            - (a command measured whole by greenctl measure: no steps of its own"
            + (f"; {r['windows']} windows" if r.get("windows") is not None else "")
            + ")"
            if r.get("measured_whole")
            else f"  steps            {r['steps']}  ({r.get('step_reports', r['steps'])} step reports from "
            f"{r.get('ranks', 0) + len(r.get('ranks_gone') or [])} rank(s))"
        ),
        f"  duration         {_num(r['duration_s'], '.1f', 's')}",
        *_parts_lines(r),
        f"  FLOPs            {_num(r['flops'], '.4g')}   ({_num(r.get('flop_per_s'), '.3g', 'FLOP/s')})",
        f"  GPU energy{label:6} {_num(r['gpu_energy_j'], '.1f', 'J')}   "
        f"avg {_num(r.get('avg_gpu_power_w'), '.1f', 'W')}",
        (
            f"  CPU energy       {_num(r['cpu_energy_j'], '.1f', 'J')}   ({r.get('cpu_energy_method')})"
            if not no_cpu
            else "  CPU energy       not measured (no readable RAPL zone, no [probes] cpu_tdp_w estimate: "
            "see greenctl doctor)"
        ),
        f"  total energy     {_num(r['energy_j'], '.1f', 'J')} = {_num(r['energy_kwh'], '.6f', 'kWh')}   "
        f"avg {_num(r.get('avg_power_w'), '.1f', 'W')}{'   (GPU only)' if no_cpu else ''}",
        f"  GFLOPS/W{label:8} {_num(r.get('gflops_per_w'), '.3f')}   "
        + (
            "(with CPU: n/a, CPU not measured)"
            if no_cpu
            else f"(with CPU: {_num(r.get('gflops_per_w_with_cpu'), '.3f')})"
        ),
    ]
    if not r.get("gpus") and not r.get("from_store"):
        lines.append(
            "  note             no GPUs registered: the GPU energy 0 J is not a measurement "
            "(give gpus=[...] to GreenCallback, or --gpus to greenctl measure)"
        )
    if r.get("gpu_energy_per_step_j") is not None:
        mean_step_s = (r.get("step_time_s") or 0.0) / max(1, r.get("step_reports") or 1)
        lines.append(
            f"  per step         {_num(r['gpu_energy_per_step_j'], '.4g', 'J')} of GPU energy, "
            f"{_num(mean_step_s, '.4g', 's')} on average"
        )
    if len(r.get("per_gpu") or []) > 1:
        for g in r["per_gpu"]:
            lines.append(
                f"    gpu{g['gpu']:<3}         {_num(g.get('energy_j'), '.1f', 'J')}   "
                f"avg {_num(g.get('avg_power_w'), '.1f', 'W')}   {_num(g.get('flops'), '.4g', 'FLOP')}   "
                f"{_num(g.get('gflops_per_w'), '.3f')} GFLOPS/W"
            )
    rec = r.get("recent")
    if rec and r.get("state") == "running":
        lines.append(
            f"  last {_num(rec.get('window_s'), '.0f', 's'):<11} {_num(rec.get('flop_per_s'), '.3g', 'FLOP/s')}   "
            f"GPU avg {_num(rec.get('gpu_power_w'), '.1f', 'W')}   {_num(rec.get('gflops_per_w'), '.3f')} GFLOPS/W"
        )
    if r.get("gflops_per_w_busy") is not None:
        lines.append(
            f"  GFLOPS/W busy    {_num(r['gflops_per_w_busy'], '.1f')}   (sim: only the simulated "
            "steps' own energy, without the idle time between them)"
        )
    if r.get("samples"):
        lines.append(f"  samples          {r['samples']}   ({_num(r.get('samples_per_j'), '.3g')} per J)")
    if r.get("tokens"):
        lines.append(f"  tokens           {r['tokens']}   ({_num(r.get('tokens_per_j'), '.3g')} per J)")
    lines.append(f"  CO2              {_num(r.get('co2_g'), '.3g', 'g')}   ({r.get('co2_method')})")
    if r.get("measured_whole"):
        lines.append("  precision        - (the command's own: not known to greend)")
    else:
        lines.append(f"  precision        {r.get('precision')}   last loss {_num(r.get('last_loss'), '.4g')}")
    if not r.get("measured_whole"):  # a command measured whole has no steps to form a baseline
        lines += render_savings(r.get("savings"), label)
    world, here = r.get("world_size") or 1, r.get("ranks_here") or 0
    if world > 1 and here < world:
        lines.append(
            f"  partial          {here} of the job's {world} ranks ran on this node: these figures are this "
            "node's share (the whole job: greenctl report JOB --store NODE1.db --store NODE2.db ...)"
        )
    for ev in r.get("precision_log") or []:
        frm = f"{ev['from']} -> " if ev.get("from") else ""  # a store keeps only where it went
        lines.append(f"    {ev.get('kind', 'switch')}: {frm}{ev.get('to')}  ({ev.get('reason')})")
    for ev in r.get("decisions") or []:
        lines.append(f"    cap: {render_setting(ev.get('setting'))}  ({ev.get('reason')})")
    notes = r.get("notes") or []
    if notes:
        lines.append("  why" + ("  (each policy's last word on the job)" if r.get("state") == "ended" else ""))
        for n in notes:
            lines.append(f"    {n.get('policy')}: {n.get('reason')}")
    return "\n".join(lines)


def _parts_lines(r: dict[str, Any]) -> list[str]:
    """A run the daemon restarted under: its parts (the figures are the whole run's), and
    the steps its ranks sent that no part holds."""
    out = []
    unseen = r.get("unseen_steps") or 0
    if unseen > 0:
        out.append(
            f"  unseen           {unseen} steps of this run went to a daemon that stopped without keeping "
            "them (killed or crashed, or they reached it while it stopped): not in these figures"
        )
    parts = r.get("parts") or []
    if len(parts) < 2:
        return out
    at = [time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p["started_at"])) for p in parts[1:] if p.get("started_at")]
    ends = [str(p.get("end_reason") or "") for p in parts[:-1]]
    why = (
        "the daemon restarted under this run"
        if all(e.startswith("interrupted") for e in ends)
        else f"this run went on in a new record after: {'; '.join(ends)}"
    )
    gap = r.get("unmeasured_s") or 0.0
    unmeasured = f" but for {gap:.1f} s between its parts, when no daemon measured it (time and energy)"
    return [
        f"  parts            {len(parts)}: {why}"
        + (f" (again at {', '.join(at)})" if at else "")
        + "; the figures are the whole run's"
        + (unmeasured if gap >= 0.1 else ""),
        *out,
    ]


def render_whole_job(w: dict[str, Any]) -> str:
    """A job across nodes (``greenctl report JOB --store A --store B``): its totals, then
    each node's share."""
    world = w.get("world_size")
    sim = " (sim)" if w.get("sim") else ""
    lines = [
        f"job {w['job']}  across {len(w['nodes'])} node(s)  ranks {w.get('ranks_found')}"
        + (f" of {world}" if world else "")
        + (f"  run {w['run_id']}" if w.get("run_id") else "")
        + (f"  ({w['other_runs']} other run(s) of this id not shown)" if w.get("other_runs") else ""),
        f"  steps            {w['steps']}  (each rank's; the largest node's count)",
        f"  duration         {_num(w.get('duration_s'), '.1f', 's')}  (the longest node's)",
        f"  FLOPs            {_num(w.get('flops'), '.4g')}  (summed)",
        f"  GPU energy       {_num(w.get('gpu_energy_j'), '.1f', 'J')}{sim}  (summed)",
        f"  total energy     {_num(w.get('energy_j'), '.1f', 'J')}  (summed, GPU and CPU)",
        f"  GFLOPS/W         {_num(w.get('gflops_per_w'), '.3f')}{sim}  (summed FLOPs over summed GPU joules)",
    ]
    if w.get("saved_gpu_energy_j") is not None:
        lines.append(
            f"  saved{sim:<12}{w['saved_gpu_energy_j']:.1f} J of GPU energy = {_num(w.get('saved_pct'), '.1f')} %"
        )
    for m in w.get("missing") or []:
        lines.append(f"  partial          {m}")
    levels = sorted({n.get("precision") for n in w["nodes"] if n.get("precision")})
    if levels:
        lines.append(f"  precision        {', '.join(levels)}  (at the end, over the nodes)")
    for e in w.get("precision_log") or []:
        step = f"step {e['step']}" if e.get("step") is not None else "step ?"
        hosts, why = ", ".join(e["hosts"]), (e.get("reason") or "")[:160]
        lines.append(f"    {step:<12} {e['kind']} -> {e.get('to') or '?'}  ({hosts}): {why}")
    lines.append("  nodes")
    for n in w["nodes"]:
        n_sim = " (sim)" if n.get("gpu_source") == "sim" else ""
        lines.append(
            f"    {n['host']:<16} ranks {n.get('ranks_here') or '?'}  steps {n.get('steps')}  "
            f"{_num(n.get('gpu_energy_j'), '.1f', 'J')}  {_num(n.get('flops'), '.4g', 'FLOP')}  "
            f"{_num(n.get('gflops_per_w'), '.3f')} GFLOPS/W{n_sim}  ({n['store']})"
        )
    return "\n".join(lines)


def render_setting(setting: dict[str, Any] | None) -> str:
    """A cap decision's setting in words: "clock cap 1395 MHz", "power limit 450 W", "uncapped"."""
    s = setting or {}
    parts = []
    if s.get("clock_cap_mhz") is not None:
        parts.append(f"clock cap {s['clock_cap_mhz']} MHz")
    if s.get("power_limit_w") is not None:
        parts.append(f"power limit {s['power_limit_w']:.0f} W")
    return ", ".join(parts) or "uncapped"


def render_savings(sv: dict[str, Any] | None, label: str = "") -> list[str]:
    """The report's saving lines: against the job's own measured baseline."""
    if not sv:
        return []
    b = sv.get("baseline") or {}
    if sv.get("saved_j") is None:
        return [f"  saved{label:9} -   ({sv.get('note')})"]
    conf = sv.get("confidence") or {}
    ci = conf.get("saved_j_95")
    if not b:  # from an SQLite store: the figures only, its baseline was not kept there
        return [
            f"  saved{label:9} {sv['saved_j']:.1f} J of GPU energy = {_num(sv.get('saved_pct'), '.1f')} %   "
            f"slowdown {_num(sv.get('slowdown_pct'), '+.1f')} %   (the baseline's details are not in the store)"
        ]
    ref = sv.get("reference") or {}
    lines = [
        f"  saved{label:9} {sv['saved_j']:.1f} J of GPU energy = {_num(sv.get('saved_pct'), '.1f')} %   "
        f"slowdown {_num(sv.get('slowdown_pct'), '+.1f')} %" + (f" against {ref['label']}" if ref.get("label") else ""),
        f"    against      its own baseline: {b.get('steps')} steps uncapped at {b.get('precision')}, "
        f"{_num(b.get('joules_per_gflop'), '.4g')} J/GFLOP in its steps; {_num(sv.get('expected_gpu_energy_j'), '.1f')}"
        " J of GPU energy expected without greend (the job's whole: the GPUs' time between steps too)",
        *_pace_lines(ref),
        f"    how sure     {conf.get('level')}"
        + (" (simulated steps: no measurement noise to bound)" if conf.get("level") == "sim" else "")
        + (f" (95 %: {ci[0]:.1f} .. {ci[1]:.1f} J)" if ci else "")
        + (f"; {sv['note']}" if sv.get("note") else ""),
    ]
    return lines


def _pace_lines(ref: dict[str, Any]) -> list[str]:
    """The pace a job's slowdown and saving are judged by, where one is known."""
    if ref.get("pace_s") is None:
        return []
    line = (
        f"    pace         the job's {ref['pace_s']:.4g} s/step (agreed across nodes); this node uncapped "
        f"{_num(ref.get('node_uncapped_step_s'), '.4g')} s/step"
    )
    if ref.get("kind") == "job_pace":
        line += "; under policy none its GPUs would have waited for the slower node"
        if ref.get("wait_j") is not None:
            line += f" ({ref['wait_j']:.1f} J of that wait counted as saved)"
    return [line]


def _saved(j: dict[str, Any]) -> str | None:
    """A job row's saved %, "(sim)" where the simulator's GPUs gave it."""
    pct = j.get("saved_pct")
    if pct is None:
        return None
    return f"{pct:.1f}" + (" (sim)" if j.get("sim") else "")


def _measured(j: dict[str, Any]) -> bool:
    """A command measured whole by ``greenctl measure``: no steps, no precision of its own."""
    return j.get("kind") == "measure" or bool(j.get("measured_whole"))


def render_jobs(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "no jobs yet"
    return render_table(
        ["JOB", "STATE", "RANKS", "GPU_IDS", "STEPS", "DURATION_S", "GPU_ENERGY_J", "GFLOPS/W", "SAVED_%", "PRECISION"],
        [
            [
                j["job"] + (f" (run {j['run']})" if (j.get("run") or 1) > 1 else ""),
                j["state"] + (" (store)" if j.get("from_store") else ""),
                # An ended job's ranks have all left: its count says nothing.
                j["ranks"] if j["state"] != "ended" else "-",
                ",".join(map(str, j.get("gpus") or [])) or "-",
                "-" if _measured(j) else j["steps"],
                j["duration_s"],
                j["gpu_energy_j"],
                j["gflops_per_w"],
                _saved(j),
                "- (measure)" if _measured(j) else j["precision"],
            ]
            for j in jobs
        ],
    )


def plot_annotations(r: dict[str, Any]) -> list[tuple[float, str]]:
    """Every cap and precision change of the job, as (seconds since its first step, label)."""
    t0 = r.get("first_step_at")
    out: list[tuple[float, str]] = []
    for ev in r.get("decisions") or []:
        out.append((ev["t"], "cap: " + render_setting(ev.get("setting"))))
    for ev in r.get("precision_log") or []:
        frm = ev.get("from")
        out.append((ev["t"], f"{ev.get('kind', 'switch')}: {frm + ' -> ' if frm else ''}{ev.get('to')}"))
    out.sort(key=lambda x: x[0])
    return [((t - t0) if t0 is not None else 0.0, text) for t, text in out]


def plot_report(r: dict[str, Any], path: Path) -> list[str]:
    """GPU power and the clock cap over the job's life, every cap and precision change
    marked and labelled, and GFLOPS/W below; power and efficiency axes from 0. Returns
    the annotations' texts, in time order."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'greend[plot]'") from e
    series = r.get("series") or []
    if not series:
        raise RuntimeError(
            f"job {r['job']} has no efficiency samples"
            + (" (a report from the store has no time series)" if r.get("from_store") else " yet (once a second)")
        )
    t = [p["t_s"] for p in series]
    label = " (sim)" if r.get("gpu_source") == "sim" else ""
    fig, (ax1, ax3) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ax1.plot(t, [p["power_w"] for p in series], color="tab:red", label=f"GPU power{label} (W)")
    ax1.set_ylabel(f"GPU power{label} (W)")
    ax1.set_ylim(bottom=0, top=max(1.0, max(p["power_w"] for p in series)) * 1.15)
    notes = plot_annotations(r)
    # The clock cap in force (a step line; "uncapped" drawn at the top of the right axis).
    ax2 = ax1.twinx()
    caps = [(x, text) for x, text in notes if text.startswith("cap: ")]
    clock_pts = [(0.0, None)] + [
        (x, int(text.split("clock cap ")[1].split(" ")[0]) if "clock cap " in text else None) for x, text in caps
    ]
    top = max([c for _, c in clock_pts if c is not None] or [2000]) * 1.1
    xs, ys = [], []
    for i, (x, c) in enumerate(clock_pts):
        x_end = clock_pts[i + 1][0] if i + 1 < len(clock_pts) else max(t[-1], x)
        xs += [x, x_end]
        ys += [c if c is not None else top, c if c is not None else top]
    ax2.plot(xs, ys, color="tab:blue", linestyle="--", label="clock cap (MHz; top = uncapped)")
    ax2.set_ylim(0, top * 1.05)
    ax2.set_ylabel("clock cap (MHz)")
    texts: list[str] = []
    for i, (x, text) in enumerate(notes):
        color = "tab:purple" if not text.startswith("cap: ") else "tab:gray"
        for ax in (ax1, ax3):
            ax.axvline(x, color=color, linewidth=0.8, alpha=0.7)
        ax1.annotate(
            text,
            xy=(x, 0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 4 + 11 * (i % 6)),
            textcoords="offset points",
            fontsize=7,
            color=color,
            rotation=0,
        )
        texts.append(text)
    ax3.plot(t, [p["gflops_per_w"] for p in series], color="tab:green", label=f"GFLOPS/W{label} (sliding window)")
    ax3.set_ylim(bottom=0)
    ax3.set_ylabel(f"GFLOPS/W{label}")
    ax3.set_xlabel("time since the first step (s)")
    per_step = r.get("gpu_energy_per_step_j")
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax3.legend(loc="upper left", fontsize=8)
    saved = (r.get("savings") or {}).get("saved_pct")
    ax1.set_title(
        f"greend job {r['job']}: {r['gpu_energy_j']:.0f} J GPU{label}, "
        f"{(r.get('gflops_per_w') or 0):.2f} GFLOPS/W"
        + (f", {per_step:.3g} J/step" if per_step else "")
        + (f", saved {saved:.1f} %" if saved is not None else "")
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return texts


def cap_notes(reply: dict[str, Any], max_clock: int | None, power_limit: float | None) -> list[str]:
    """What ``greenctl cap set`` adds under its answer: a value the GPU holds other than the
    one greend wrote (a driver that ignored or changed the write: said as such, never blamed
    on the value asked), else a limit clamped to the GPU's range or a clock snapped to a
    supported one."""
    gpu, f = reply["gpu"], reply["in_force"]
    held = reply.get("held") or {}  # knob -> {"asked": what greend wrote, "held": what the GPU holds}
    notes = [
        f"greend wrote {held[knob]['asked']:g} {unit}, gpu{gpu}'s driver holds {held[knob]['held']:g} {unit} "
        "(greend reports and measures what it holds)"
        for knob, unit in (("clock_cap_mhz", "MHz"), ("power_limit_w", "W"))
        if knob in held
    ]
    got = f.get("power_limit_w")
    if power_limit is not None and got is not None and abs(got - power_limit) > 0.05 and "power_limit_w" not in held:
        notes.append(f"{power_limit:g} W is outside gpu{gpu}'s power limit range: clamped to {got:.1f} W")
    clock = f.get("clock_cap_mhz")
    if max_clock is not None and clock is not None and clock != max_clock and "clock_cap_mhz" not in held:
        notes.append(f"{max_clock} MHz snapped to the supported clock {clock} MHz")
    return notes
