"""``greenctl profile``: record a job's power-limit profile on this node's GPU.

``greenctl profile record --gpu 0 --job J --out j.csv`` asks the daemon (op ``profile``,
admin only) to step GPU 0's power limit down while job ``J`` runs on it, measuring at
each limit the job's step time and the GPU's average power, and writes what it measured
in greend's trace format: ``greend run --sim 1 --sim-trace j.csv`` replays it, so each
policy can be tried offline on the job's own curve. The daemon saves the original limit
before its first write and puts it back at the end, on ``greenctl profile abort`` (or
Ctrl-C here), when the job ends, and when the daemon stops.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import typer

from greend.cli.common import fail, request

__all__ = ["profile_app"]

profile_app = typer.Typer(
    no_args_is_help=True, help="Record a job's power-limit profile (step time and power per limit) on one GPU."
)

POLL_S = 0.5


def _row_line(r: dict[str, Any], top: dict[str, Any] | None) -> str:
    line = f"  {r['power_limit_w']:>7g} W  {r['step_time_s']:.4g} s/step  {r['avg_power_w']:7.1f} W avg"
    if top is not None and top is not r:
        dt = r["step_time_s"] / top["step_time_s"] - 1.0
        de = r["step_time_s"] * r["avg_power_w"] / (top["step_time_s"] * top["avg_power_w"]) - 1.0
        line += f"  {dt:+6.1%} time  {de:+6.1%} energy/step"
    return line + f"  ({r['steps']} steps)"


def _comments(st: dict[str, Any]) -> tuple[str, ...]:
    when = time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(st.get("started_wall") or time.time()))
    out = [
        f"recorded by greenctl profile record on {st.get('host') or '?'}, {when}",
        f"gpu {st['gpu']} ({st.get('gpu_name') or '?'}, source={st.get('source') or '?'}), job {st['job']}, "
        f"{st['steps_per_limit']} steps per limit; original limit {st.get('original_w')} W",
        f"step_time_s: the job's mean step time at the limit; avg_power_w: GPU {st['gpu']}'s average power",
    ]
    if st.get("state") != "done":
        out.append(f"incomplete: {st.get('state')} ({st.get('reason')})")
    return tuple(out)


def _write(out: Path, name: str, st: dict[str, Any]) -> None:
    from greend.probes.trace import format_profile

    text = format_profile(name, st["rows"], _comments(st))
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    tmp.replace(out)


@profile_app.command("record")
def profile_record(
    gpu: int = typer.Option(..., "--gpu", help="the GPU whose power limit is stepped (node-local index)"),
    job: str = typer.Option(..., "--job", help="a running job on that GPU whose steps are measured"),
    out: Path = typer.Option(..., "--out", help="the profile to write (CSV, greend's trace format)"),
    from_w: float | None = typer.Option(None, "--from", help="first (highest) limit, W; default the GPU's default"),
    to_w: float | None = typer.Option(None, "--to", help="last (lowest) limit, W; default the GPU's minimum"),
    step_w: float | None = typer.Option(None, "--step", help="W between limits; default an eighth of the range"),
    steps_per_limit: int = typer.Option(20, "--steps-per-limit", help="job steps measured at each limit (>= 2)"),
    name: str | None = typer.Option(None, "--name", help="the profile's name (default: the job id and GPU)"),
    as_json: bool = typer.Option(False, "--json", metavar="", help="print the daemon's final status as JSON"),
) -> None:
    """Step GPU --gpu's power limit down while --job runs; write step time and power per limit."""
    if steps_per_limit < 2:
        fail(f"--steps-per-limit {steps_per_limit}: expected 2 or more steps")
    if not out.parent.is_dir():
        fail(f"--out {out}: the directory {out.parent} does not exist")
    if out.is_dir():
        fail(f"--out {out}: is a directory; name a file")
    profile_name = name or re.sub(r"[^A-Za-z0-9._+-]", "_", f"{job}+gpu{gpu}")
    fields: dict[str, Any] = {"action": "start", "gpu": gpu, "job": job, "steps_per_limit": steps_per_limit}
    for key, value in (("from_w", from_w), ("to_w", to_w), ("step_w", step_w)):
        if value is not None:
            fields[key] = float(value)
    st = request("profile", **fields)
    limits = ", ".join(f"{w:g}" for w in st["limits_w"])
    typer.echo(
        f"recording gpu {gpu} for job {job}: {limits} W, {st['steps_per_limit']} steps each "
        f"(original limit {st.get('original_w')} W; Ctrl-C aborts and restores it)"
    )
    shown = 0
    try:
        while True:
            rows = st.get("rows") or []
            for r in rows[shown:]:
                typer.echo(_row_line(r, rows[0] if rows else None))
            shown = len(rows)
            if st.get("state") != "running":
                break
            time.sleep(POLL_S)
            st = request("profile", action="status")
    except KeyboardInterrupt:
        typer.echo("interrupted: aborting the recording (the daemon restores the limit)", err=True)
        try:
            st = request("profile", action="abort")
        except (SystemExit, typer.Exit):
            st = request("profile", action="status")
    if as_json:
        typer.echo(json.dumps(st, indent=2))
    restored = "; ".join(st.get("restored") or []) or "nothing to restore"
    typer.echo(f"{st.get('state')}: {st.get('reason')}; restored: {restored}")
    rows = st.get("rows") or []
    if len(rows) >= 2:
        _write(out, profile_name, st)
        typer.echo(
            f"wrote {out} ({len(rows)} limits{'' if st.get('state') == 'done' else ', incomplete'}); "
            f"replay it: greend run --sim 1 --sim-trace {out}"
        )
    else:
        typer.echo(f"not written: {len(rows)} limit(s) measured, a profile needs 2", err=True)
    if st.get("state") != "done":
        raise typer.Exit(1)


@profile_app.command("status")
def profile_status(as_json: bool = typer.Option(False, "--json", metavar="", help="machine-readable")) -> None:
    """The running (or last) recording: its limits, the rows measured so far."""
    st = request("profile", action="status")
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    if st.get("state") == "none":
        typer.echo("no profile recording since the daemon started")
        return
    head = f"gpu {st['gpu']}, job {st['job']}: {st['state']}"
    if st["state"] == "running":
        head += f", at {st['current_limit_w']:g} W ({st['steps_now']}/{st['steps_per_limit']} steps)"
    elif st.get("reason"):
        head += f" ({st['reason']})"
    typer.echo(head)
    rows = st.get("rows") or []
    for r in rows:
        typer.echo(_row_line(r, rows[0]))


@profile_app.command("abort")
def profile_abort() -> None:
    """Stop the running recording; its GPU's power limit goes back to the original."""
    st = request("profile", action="abort")
    typer.echo(f"aborted; restored: {'; '.join(st.get('restored') or []) or 'nothing to restore'}")
