"""``greenctl top``: the node live, refreshed in place (GPUs, caps, jobs, policy).

Each refresh is one ``status`` request. A job's *current* efficiency is measured here,
between two refreshes: the FLOPs it reported over the energy its GPUs used in that
interval (``ΔFLOPs / ΔJ``), beside the job's whole-run figure. The daemon going away
is shown in the frame, and ``top`` keeps trying until it is back or Ctrl-C.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from greend.cli.render import fixed_point, fmt
from greend.cli.top_keys import HELP_LINE, KEYS_LINE, TerminalKeys
from greend.errors import GreendError

__all__ = ["SORT_KEYS", "Frame", "KeysShown", "render_frame", "run_top"]


@dataclass
class Frame:
    """What one refresh saw, and the current figures measured against the previous one."""

    status: dict[str, Any] | None
    at_s: float
    error: str | None = None
    # job id -> (GFLOPS/W over the last interval, steps/s over the last interval)
    current: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)


def _num(v: Any, spec: str = ".0f", unit: str = "") -> str:
    if v is None:
        return "-"
    if spec != ".0f" and fixed_point(spec) and isinstance(v, (int, float)):
        return f"{fmt(float(v), int(spec[1:-1]))}{unit}"  # (0.00015 GFLOPS/W, not 0.00)
    return f"{v:{spec}}{unit}"


def measure(prev: Frame | None, status: dict[str, Any] | None, at_s: float, error: str | None = None) -> Frame:
    frame = Frame(status=status, at_s=at_s, error=error)
    if status is None or prev is None or prev.status is None:
        return frame
    dt = at_s - prev.at_s
    before = {j["job"]: j for j in prev.status.get("jobs", [])}
    for j in status.get("jobs", []):
        b = before.get(j["job"])
        if b is None or j.get("state") != "running":
            continue
        d_flops = (j.get("flops") or 0.0) - (b.get("flops") or 0.0)
        d_j = (j.get("gpu_energy_j") or 0.0) - (b.get("gpu_energy_j") or 0.0)
        d_steps = (j.get("steps") or 0) - (b.get("steps") or 0)
        gflops_w = d_flops / d_j / 1e9 if d_j > 0 and d_flops > 0 else None
        frame.current[j["job"]] = (gflops_w, d_steps / dt if dt > 0 else None)
    return frame


def _table(title: str) -> Table:
    """A table that fits 80 columns: no vertical rules, one space between columns."""
    return Table(title=title, title_justify="left", expand=False, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)


def _gpu_table(st: dict[str, Any]) -> Table:
    t = _table("GPUs")
    # "SMs %": the share of the SMs busy (NVML's GPM, Hopper and newer; "-" elsewhere)
    heads = ("GPU", "name", "power\nW", "limit\nW", "SM\nMHz", "cap\nMHz", "util\n%", "SMs\n%", "temp\nC", "energy\nJ")
    for h in heads:
        t.add_column(h, justify="left" if h in ("GPU", "name") else "right")
    for g in st.get("gpus", []):
        rng = g.get("power_limit_range_w") or [None, None]
        limit = g.get("power_limit_w")
        capped_power = limit is not None and rng[1] is not None and limit < rng[1]
        t.add_row(
            f"gpu{g['index']}" + (" (sim)" if g.get("source") == "sim" else ""),
            _short_name(g.get("name")),
            _num(g.get("power_w"), ".1f"),
            Text(_num(limit), style="bold yellow" if capped_power else ""),
            _num(g.get("sm_clock_mhz")),
            Text(_num(g.get("clock_cap_mhz")), style="bold yellow" if g.get("clock_cap_mhz") else ""),
            _num(g.get("util_gpu_pct")),
            _num(g.get("sm_active_pct")),
            _num(g.get("temperature_c")),
            _num(g.get("energy_j"), ".0f"),
        )
    return t


def _short_name(name: Any) -> str:
    """A GPU's name in a narrow column: "H100 80GB HBM3" (the vendor and "(simulated)"
    are said by the GPU column's "(sim)")."""
    text = str(name or "-").removeprefix("NVIDIA ")
    return text.replace(" (simulated)", "")


# --sort: the jobs table's order (largest first but for the job's name).
SORT_KEYS: dict[str, str] = {
    "job": "the job's name",
    "energy": "the job's energy so far",
    "now": "GFLOPS/W over the last interval",
    "run": "GFLOPS/W over the job's run",
    "steps": "steps so far",
    "rate": "steps/s over the last interval",
}


def _sorted_jobs(jobs: list[dict[str, Any]], frame: Frame, sort: str) -> list[dict[str, Any]]:
    if sort == "job":
        return sorted(jobs, key=lambda j: str(j["job"]))

    def key(j: dict[str, Any]) -> float:
        now_eff, rate = frame.current.get(j["job"], (None, None))
        v = {
            "energy": j.get("energy_j"),
            "now": now_eff,
            "run": j.get("gflops_per_w"),
            "steps": j.get("steps"),
            "rate": rate,
        }[sort]
        return -(v if isinstance(v, (int, float)) else float("-inf"))

    return sorted(jobs, key=key)


def _job_table(st: dict[str, Any], frame: Frame, sort: str = "job") -> Table:
    t = _table(f"Jobs (by {SORT_KEYS[sort]})")
    t.add_column("job", overflow="fold")  # a long id folds onto a second line, never cut
    for h in ("state", "GPUs", "steps", "steps\n/s", "GFLOPS/W\nnow", "GFLOPS/W\nrun", "energy\nJ", "saved"):
        t.add_column(h, justify="left" if h == "state" else "right")
    jobs = _sorted_jobs(st.get("jobs", []), frame, sort)
    for j in jobs:
        now_eff, rate = frame.current.get(j["job"], (None, None))
        saved = j.get("saved_pct")
        t.add_row(
            str(j["job"]),
            str(j.get("state")),
            ",".join(str(x) for x in j.get("gpus") or []) or "-",
            "-" if j.get("kind") == "measure" else str(j.get("steps", 0)),  # windows, not steps
            "-" if j.get("kind") == "measure" else _num(rate, ".1f"),
            _num(now_eff, ".2f"),
            _num(j.get("gflops_per_w"), ".2f"),
            _num(j.get("energy_j"), ".0f"),
            "-" if saved is None else f"{saved:.1f}%" + (" (sim)" if j.get("sim") else ""),
        )
    if not jobs:
        t.add_row("(none)", "", "", "", "", "", "", "", "")
    return t


def render_frame(
    frame: Frame, *, socket: str, interval_s: float, sort: str = "job", keys: KeysShown | None = None
) -> RenderableType:
    """One frame; ``keys``: what the keys did, on a terminal that has them (None: no keys)."""
    if keys is None:
        head = Text(f"greend top  {socket}  every {interval_s:g} s  (Ctrl-C to quit)", style="bold")
    else:
        state = "PAUSED (p resumes)" if keys.paused else f"every {interval_s:g} s"
        head = Text(f"greend top  {socket}  {state}  ({KEYS_LINE})", style="bold")
        if keys.help:
            head = Text.assemble(head, "\n", Text(HELP_LINE, style="dim"))
    if frame.status is None:
        return Group(head, Text(f"daemon unavailable: {frame.error}; retrying", style="bold red"))
    st = frame.status
    pol = st.get("policy") or {}
    tot = st.get("totals") or {}
    line = (
        f"host {st.get('host')}  greend {st.get('version')}  policy {pol.get('name', '-')}"
        + (f" + precision {pol['precision']['name']}" if isinstance(pol.get("precision"), dict) else "")
        + f"  GPU energy {_num(tot.get('gpu_energy_j'), '.0f')} J"
        + (f"  CPU energy {_num(tot.get('cpu_energy_j'), '.0f')} J" if tot.get("cpu_energy_j") else "")
        + ("  DRY RUN (caps not applied)" if st.get("dry_run") else "")
    )
    parts: list[RenderableType] = [head, Text(line), _gpu_table(st), _job_table(st, frame, sort)]
    last = pol.get("last_decision") or {}
    if last.get("reason"):
        parts.append(Text(f"last decision: {last['reason']}"))
    if pol.get("last_error"):
        parts.append(Text(f"policy error: {pol['last_error']}", style="red"))
    parts.append(Text("GFLOPS/W now: the job's FLOPs over its GPUs' joules since the last refresh", style="dim"))
    return Group(*parts)


@dataclass
class KeysShown:
    """What the keys have done (``top`` on a terminal): refreshes paused, help shown."""

    paused: bool = False
    help: bool = False


def run_top(
    request: Callable[[], dict[str, Any]],
    *,
    socket: str,
    interval_s: float,
    once: bool = False,
    console: Console | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    sort: str = "job",
    keys: TerminalKeys | None = None,
) -> None:
    """Refresh until Ctrl-C. ``once``: take two readings ``interval_s`` apart (so the
    current figures exist) and print that one frame (for scripts and pipes). ``sort``:
    the jobs' order (:data:`SORT_KEYS`). ``keys``: the terminal's keys (q, s < >, p, ?:
    :mod:`greend.cli.top_keys`), None where stdin is not a terminal."""
    if sort not in SORT_KEYS:
        raise GreendError(f"--sort {sort!r}: expected one of {', '.join(SORT_KEYS)}")
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a file: $COLUMNS if set, else 80, as a terminal
            console = Console(width=shutil.get_terminal_size((80, 24)).columns)

    def read(prev: Frame | None) -> Frame:
        try:
            return measure(prev, request(), clock())
        except GreendError as e:
            return measure(None, None, clock(), error=str(e))

    frame = read(None)
    if once:
        if frame.status is not None:
            sleep(interval_s)
            frame = read(frame)
        if frame.status is None:
            raise GreendError(frame.error or "daemon unavailable")
        console.print(render_frame(frame, socket=socket, interval_s=interval_s, sort=sort))
        return
    if keys is not None:
        _run_with_keys(read, frame, keys, console, clock, socket=socket, interval_s=interval_s, sort=sort)
        return
    if not console.is_terminal:  # a pipe or a file: each frame as it is read (a Live writes only its last, at exit)
        try:
            while True:
                console.print(render_frame(frame, socket=socket, interval_s=interval_s, sort=sort))
                console.file.flush()
                sleep(interval_s)
                frame = read(frame)
        except KeyboardInterrupt:  # Ctrl-C (a reader that left, `| head`: rich's own broken-pipe exit, 1)
            return
    try:
        with Live(
            render_frame(frame, socket=socket, interval_s=interval_s, sort=sort),
            console=console,
            auto_refresh=False,
            transient=False,
        ) as live:
            while True:
                sleep(interval_s)
                frame = read(frame)
                live.update(render_frame(frame, socket=socket, interval_s=interval_s, sort=sort), refresh=True)
    except KeyboardInterrupt:
        return


def _run_with_keys(
    read: Callable[[Frame | None], Frame],
    frame: Frame,
    keys: TerminalKeys,
    console: Console,
    clock: Callable[[], float],
    *,
    socket: str,
    interval_s: float,
    sort: str,
) -> None:
    """The live frame on a terminal: a key acts at once (the frame drawn again with what
    it changed, no new reading); readings every ``interval_s`` unless paused. The
    terminal is given back as it was on ``q``, Ctrl-C and any error."""
    shown = KeysShown()
    order = list(SORT_KEYS)

    def draw() -> RenderableType:
        return render_frame(frame, socket=socket, interval_s=interval_s, sort=sort, keys=shown)

    try:
        with keys, Live(draw(), console=console, auto_refresh=False, transient=False) as live:
            due = clock() + interval_s
            while True:
                pressed = keys.wait(due - clock())
                for key in pressed:
                    if key in "qQ":
                        return
                    if key in "sS>" or key == "<":
                        step = -1 if key == "<" else 1
                        sort = order[(order.index(sort) + step) % len(order)]
                    elif key in "pP":
                        shown.paused = not shown.paused
                    elif key == "?":
                        shown.help = not shown.help
                if not pressed and clock() >= due:
                    due = clock() + interval_s
                    if shown.paused:
                        continue
                    frame = read(frame)
                live.update(draw(), refresh=True)
    except KeyboardInterrupt:
        return
