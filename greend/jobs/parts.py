"""One run across daemon restarts: its parts joined into one record.

When the daemon stops under a running job, the job's record ends ("interrupted: the
daemon stopped") and is kept (the archive, the stores). The training's callback keeps
its steps meanwhile, reconnects to the restarted daemon and registers again with its
run id, and a new record goes on from there, starting with the steps held over the gap.
The two records are *parts* of one run: the same job id and run id, the earlier one
ended by the daemon's stop (:func:`runs_of`). A record whose ranks' heartbeats or
connections were lost is different: the daemon continues that same record when they
come back, and its later copy replaces the earlier one. A user asks about
the run, not about the daemon's lives, so the reports, ``greenctl jobs`` and the
stores' readers join the parts here:

* what adds up is summed (steps, FLOPs, samples, tokens, seconds, joules, CO2, the
  saving and the energy it is taken against); a figure one part did not measure (no
  GPU energy, no baseline) makes the sum unknown, never a sum of the others;
* the rates are computed again from the sums (GFLOPS/W is summed FLOPs over summed
  joules, never a mean of the parts' quotients);
* the logs run on (decisions, precision switches, notes, ranks gone, a plot's series);
* everything else (the state, the level at the end, the latest notes) is the latest
  part's, and ``parts`` lists each part (when, how many steps, how it ended).

Pure functions on dicts: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from greend.jobs.records import DISCONNECTED, EXPIRED, INTERRUPTED

__all__ = ["join_reports", "join_rows", "runs_of", "unseen_steps"]

# Figures that add up across parts: a report's, and a row's (greenctl jobs, greend_job).
_SUMMED = (
    "steps",
    "step_reports",
    "flops",
    "samples",
    "tokens",
    "duration_s",
    "gpu_energy_j",
    "cpu_energy_j",
    "node_cpu_energy_j",
    "energy_j",
    "energy_kwh",
    "co2_g",
    "nonfinite_steps",
    "probe_steps",
    "cap_changes",
    "sim_time_s",
    "sim_energy_j",
    "step_time_s",
)
# (the saving is summed by _saving, each part's from its report or row; sent_before is the
# latest part's own: what its ranks sent before it, kept or not)
# Counts: a part without one counted none.
_COUNTS = frozenset({"steps", "step_reports", "nonfinite_steps", "probe_steps", "cap_changes"})
_LOGS = ("decisions", "precision_log", "series")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _sum(parts: list[dict[str, Any]], key: str) -> Any:
    """The parts' sum of ``key`` (an int where each is); None where a part that has the
    field does not know it (a count: a part without it counted none)."""
    present = [p.get(key) for p in parts if key in p]
    if not present:
        return None
    if key in _COUNTS:
        present = [v if _num(v) is not None else 0 for v in present]
    if any(_num(v) is None for v in present):
        return None
    return sum(present)


def _saved_j(part: dict[str, Any]) -> float | None:
    """A part's saved GPU joules: stored flat, else from its saving's share of its energy."""
    sav = part.get("savings")
    if isinstance(sav, dict):  # a report's
        return _num(sav.get("saved_j"))
    s = _num(part.get("saved_gpu_energy_j"))  # a stored row's
    if s is not None:
        return s
    pct, gpu_e = _num(part.get("saved_pct")), _num(part.get("gpu_energy_j"))
    if pct is not None and gpu_e is not None and pct < 100.0:
        return gpu_e * pct / (100.0 - pct)  # saved_pct = saved / (used + saved)
    return None


def _part_line(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "started_at": p.get("started_at"),
        "ended_at": p.get("ended_at"),
        "steps": p.get("steps"),
        "duration_s": p.get("duration_s"),
        "gpu_energy_j": p.get("gpu_energy_j"),
        "end_reason": p.get("end_reason"),
        "state": p.get("state"),
    }


_RATES = (
    "gflops_per_w", "avg_power_w", "avg_gpu_power_w", "flop_per_s", "gflops_per_w_with_cpu",
    "gpu_energy_per_step_j", "gflops_per_w_busy", "samples_per_j", "tokens_per_j",
)  # fmt: skip


def _rates(parts: list[dict[str, Any]], out: dict[str, Any]) -> None:
    """The rates again, from the summed figures (a rate a part could not give, the whole
    run cannot either)."""
    flops, gpu_e, energy = _num(out.get("flops")), _num(out.get("gpu_energy_j")), _num(out.get("energy_j"))
    duration, steps = _num(out.get("duration_s")), _num(out.get("steps"))
    out["gflops_per_w"] = flops / gpu_e / 1e9 if flops and gpu_e else None
    if "avg_power_w" in out:
        out["avg_power_w"] = energy / duration if energy is not None and duration else None
    if "avg_gpu_power_w" in out:
        out["avg_gpu_power_w"] = gpu_e / duration if gpu_e is not None and duration else None
    if "flop_per_s" in out:
        out["flop_per_s"] = flops / duration if flops is not None and duration else None
    if "gflops_per_w_with_cpu" in out:
        with_cpu = out["gflops_per_w_with_cpu"] is not None
        out["gflops_per_w_with_cpu"] = flops / energy / 1e9 if with_cpu and flops and energy else None
    if "gpu_energy_per_step_j" in out:
        out["gpu_energy_per_step_j"] = gpu_e / steps if gpu_e is not None and steps else None
    if "gflops_per_w_busy" in out:
        sim_e = _num(out.get("sim_energy_j"))
        out["gflops_per_w_busy"] = flops / sim_e / 1e9 if flops and sim_e else None
    for per, count in (("samples_per_j", "samples"), ("tokens_per_j", "tokens")):
        if per in out:
            n = _num(out.get(count))
            out[per] = n / energy if n is not None and energy else None
    for key in _RATES:
        # (a part with no steps has no rates of its own: it vetoes none of the run's)
        if any(key in p and p[key] is None and (_num(p.get("steps")) or 0) > 0 for p in parts):
            out[key] = None


def _saving(parts: list[dict[str, Any]], out: dict[str, Any]) -> None:
    """The saving over the whole run: each part's against its own baseline, summed."""
    saved = [_saved_j(p) for p in parts]
    gpu_e = _num(out.get("gpu_energy_j"))
    total = sum(s for s in saved if s is not None) if all(s is not None for s in saved) else None
    pct = 100.0 * total / (gpu_e + total) if total is not None and gpu_e is not None and gpu_e + total > 0 else None
    if any("saved_gpu_energy_j" in p or "savings" in p for p in parts):
        out["saved_gpu_energy_j"] = total
    out["saved_pct"] = pct
    sav: list[dict[str, Any]] = [p["savings"] for p in parts if isinstance(p.get("savings"), dict)]
    if len(sav) < len(parts):
        # Rows carry flat figures only: each part's time over what it would have taken.
        slows = [_num(p.get("slowdown_pct")) for p in parts]
        spans = [_num(p.get("duration_s")) for p in parts]
        if "slowdown_pct" in out:
            out["slowdown_pct"] = None
            if total is not None and all(v is not None for v in slows + spans):
                took = sum((d or 0.0) / (1.0 + (s or 0.0) / 100.0) for s, d in zip(slows, spans, strict=True))
                out["slowdown_pct"] = 100.0 * (sum(d or 0.0 for d in spans) / took - 1.0) if took > 0 else None
        return
    refs = [s.get("reference") or {} for s in sav]
    expected = [_num(r.get("time_s")) for r in refs]
    actual = [_num(r.get("actual_time_s")) for r in refs]
    slow = None
    if total is not None and all(v is not None for v in expected + actual):
        e_t = sum(v or 0.0 for v in expected)
        slow = 100.0 * (sum(v or 0.0 for v in actual) / e_t - 1.0) if e_t > 0 else None
    out["slowdown_pct"] = slow
    whole = dict(sav[-1])
    whole.update(
        {
            "saved_j": total,
            "saved_pct": pct,
            "slowdown_pct": slow,
            "gpu_energy_j": gpu_e if total is not None else None,
            "expected_gpu_energy_j": gpu_e + total if total is not None and gpu_e is not None else None,
            "controlled": any(bool(s.get("controlled")) for s in sav),
        }
    )
    if all(s is None for s in saved):
        return  # no part measured a saving: the latest part's word on why stands
    if total is None:
        missing = sum(1 for s in saved if s is None)
        whole["note"] = (
            f"no saving for the whole run: {missing} of its {len(parts)} parts (the daemon restarted under it) "
            "measured no baseline"
        )
        whole["confidence"] = {"level": "none", "rel_stderr": None, "saved_j_95": None}
    else:
        order = ("none", "low", "medium", "high", "sim")
        confs = [s.get("confidence") or {} for s in sav]
        levels = [c.get("level") for c in confs if c.get("level") in order]
        pairs = [c.get("saved_j_95") for c in confs]
        interval = None
        if all(isinstance(x, list) and len(x) == 2 for x in pairs):
            interval = [sum(x[0] for x in pairs if x), sum(x[1] for x in pairs if x)]
        whole["confidence"] = {
            "level": min(levels, key=order.index) if levels else "none",  # the least sure part's
            "rel_stderr": None,
            "saved_j_95": interval,
        }
    out["savings"] = whole


def _per_gpu(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by: dict[Any, list[dict[str, Any]]] = {}
    for p in parts:
        for g in p.get("per_gpu") or []:
            by.setdefault(g.get("gpu"), []).append(g)
    out = []
    for gpu, rows in by.items():
        flops = sum(_num(r.get("flops")) or 0.0 for r in rows)
        es = [_num(r.get("energy_j")) for r in rows]
        e = sum(v for v in es if v is not None) if all(v is not None for v in es) else None
        merged = dict(rows[-1])
        merged.update(
            {
                "gpu": gpu,
                "flops": flops,
                "energy_j": e,
                "gflops_per_w": flops / e / 1e9 if e and flops else None,
                "avg_power_w": None,  # (each part's over its own span; the sum of spans is not the GPU's)
                "flop_per_s": None,
            }
        )
        out.append(merged)
    return out


def _end_s(part: dict[str, Any]) -> float | None:
    """When a part ended (a report's ``ended_at``; a stored row's time)."""
    end = _num(part.get("ended_at"))
    ts = _num(part.get("ts_ns"))
    return end if end is not None else (ts / 1e9 if ts is not None else None)


def _join(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(parts[-1])
    first = parts[0]
    for key in _SUMMED:
        if any(key in p for p in parts):
            out[key] = _sum(parts, key)
    for key in ("started_at", "first_step_at"):
        if key in first:
            out[key] = first.get(key)
    out["parts"] = [_part_line(p) for p in parts]
    # The seconds between the parts, no daemon measuring (a restart): not in the figures.
    gaps = [(_num(b.get("started_at")), _end_s(a)) for a, b in zip(parts, parts[1:], strict=False)]
    if gaps and all(s is not None and e is not None for s, e in gaps):
        out["unmeasured_s"] = sum(max(0.0, (s or 0.0) - (e or 0.0)) for s, e in gaps)
    _rates(parts, out)
    _saving(parts, out)
    return out


def unseen_steps(parts: list[dict[str, Any]]) -> int:
    """Steps the run's ranks sent that no part holds: sent to a daemon that stopped without
    keeping them (killed, crashed, or steps that reached it while it stopped). The latest
    part's ranks say how many they sent before it; the earlier parts hold what was kept."""
    before = _num(parts[-1].get("sent_before"))  # (None: a callback from before it said)
    kept = sum(_num(p.get("steps")) or 0.0 for p in parts[:-1])
    return max(0, int((before or 0.0) - kept))


def join_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row (``greenctl jobs``' shape, or a stored ``greend_job`` row) for the parts of
    one run, oldest first (``unseen_steps`` where its rows say). A single part comes back
    as it is."""
    out = dict(rows[0]) if len(rows) == 1 else _join(rows)
    if "sent_before" in rows[-1]:
        out["unseen_steps"] = unseen_steps(rows)
    return out


def join_reports(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for the parts of one run (each a report as the daemon gives it), oldest
    first, with ``unseen_steps``. A single part comes back as it is."""
    if len(parts) == 1:
        one = {**parts[0], "unseen_steps": unseen_steps(parts)}
        one.pop("ended_at", None)  # (the archive's, for the gaps: a report has none of its own)
        return one
    out = _join(parts)
    out.pop("ended_at", None)
    out["unseen_steps"] = unseen_steps(parts)
    for key in _LOGS:
        if any(isinstance(p.get(key), list) for p in parts):
            out[key] = [x for p in parts for x in (p.get(key) or [])]
    # A rank "left" where the daemon stopped under it: it went on, into the next part.
    out["ranks_gone"] = [
        g
        for p in parts[:-1]
        for g in (p.get("ranks_gone") or [])
        if not (isinstance(g, dict) and str(g.get("reason", "")).startswith(INTERRUPTED))
    ] + list(parts[-1].get("ranks_gone") or [])
    if any("per_gpu" in p for p in parts):
        out["per_gpu"] = _per_gpu(parts)
    out["gpus"] = sorted({g for p in parts for g in (p.get("gpus") or [])})
    # The window of recent steps and the step-time figures are the latest part's own.
    return out


def _run_id(record: dict[str, Any]) -> Hashable | None:
    return record.get("run_id") or None


def _follows(prev: dict[str, Any], record: dict[str, Any]) -> str | None:
    """What ``record``, the next record of ``prev``'s run id, is to it:

    * ``"part"``: ``prev`` ended because the daemon stopped under the run (or is an
      earlier record the daemon no longer held): the run went on in a new record;
    * ``"resumed"``: ``prev`` ended because its ranks' heartbeats or connections were
      lost, and the daemon continued that same record when they came back (it holds
      ``prev``'s steps too, and starts when ``prev`` did): it replaces ``prev``;
    * None: ``prev`` ended with the run's own end (``finished``, a failure), or
      ``record``'s ranks had sent no step before it (new processes: a rerun or an
      elastic restart whose launcher gave them the same run id): another run.
    """
    why = prev.get("end_reason")
    if not isinstance(why, str):
        return None
    # Its ranks had sent nothing before it: new processes (a rerun, an elastic restart),
    # another run. (None or absent: a callback from before it said; not known.)
    fresh = record.get("sent_before") == 0
    if why.startswith(INTERRUPTED):
        return None if fresh else "part"
    if why.startswith(EXPIRED) or why == DISCONNECTED:
        a, b = prev.get("started_at"), record.get("started_at")
        if a is None or b is None or a == b:
            return "resumed"  # the same record, continued (a first record's copies both say 0 sent)
        return None if fresh else "part"
    return None


def runs_of(
    records: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable | None] = _run_id
) -> list[list[dict[str, Any]]]:
    """``records`` (oldest first) grouped into runs: the parts of each run, oldest first
    (see :func:`_follows`: a record after a daemon's stop is a part, a record the daemon
    continued replaces its earlier copy, a record after the run's own end starts another
    run). A record whose key is None is a run of its own. The runs come in the order of
    their latest parts."""
    runs: list[list[dict[str, Any]]] = []
    last_at: list[int] = []
    latest: dict[Hashable, int] = {}  # key -> its latest run's place in ``runs``
    for i, record in enumerate(records):
        k = key(record)
        j = latest.get(k) if k is not None else None
        how = _follows(runs[j][-1], record) if j is not None else None
        if j is not None and how is not None:
            if how == "resumed":
                runs[j][-1] = record
            else:
                runs[j].append(record)
            last_at[j] = i
            continue
        runs.append([record])
        last_at.append(i)
        if k is not None:
            latest[k] = len(runs) - 1
    return [runs[j] for j in sorted(range(len(runs)), key=last_at.__getitem__)]
