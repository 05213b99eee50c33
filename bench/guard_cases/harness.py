"""The accuracy guard's harder cases: each workload under a real `greend run --sim 1` (policy
defaults) beside its fp32 twin (the same script and seed without greend, any event at the
same step).

  python bench/guard_cases/harness.py SCRIPT --seeds 0,1 [--tag T] [--out DIR] -- [script args]

The workloads (each script's docstring says more):

* ``field_fit.py``: a neural field (Fourier features, raw 0-255 pixel targets) whose
  features bf16 rounds per input: weights fit to bf16's rounding (harmful);
  ``--fp32-encoding``: only the outputs' rounding, a penalty that grows late (harmful);
* ``shift_cls.py``: a noisy 20-class tabular classifier with events placed against the
  guard's own schedule (``--event-at trial0:-2``, ``down:+8``, ``probe3:+1``...): a harder
  curriculum step, bad batches, a learning-rate drop, a warm restart, a slow drift
  (harmless: the twin meets them alike);
* ``seq_lm.py``: a character language model, heavy-tailed lengths, batches bucketed by
  length and read in a fixed order (harmless, noisy, autocorrelated).

For example (one bad batch 8 steps after the switch; a harmless job that should keep bf16):

  python bench/guard_cases/harness.py bench/guard_cases/shift_cls.py --seeds 0,1 -- --steps 2000 \
      --kind badrun --bad-len 1 --event-at down:+8

Prints per seed: switch step, rollbacks (+reasons), eval and as-run (last 300 steps) vs twin, saved (sim),
upper % (bench_precision's definition), and saves DIR/TAG-SEED.json (the run, its twin, the report)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from greend.ipc.client import Client  # noqa: E402
from greend.testing.daemon_proc import PRECISION_SIM_CONFIG, running_daemon  # noqa: E402
from greend.training.probe import trial_start  # noqa: E402

PY = sys.executable


def train(script: str, *args: str) -> dict:
    out = subprocess.run([PY, script, *args], capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"{script} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tail(r: dict, n: int = 300) -> float:
    t = r["losses"][-n:]
    return sum(t) / len(t)


def main() -> None:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, extra = argv[:k], argv[k + 1 :]
    ap = argparse.ArgumentParser()
    ap.add_argument("script")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--out", default=".", help="where each run and its twin are saved (JSON)")
    a = ap.parse_args(argv)
    tag = a.tag or Path(a.script).stem
    with running_daemon(PRECISION_SIM_CONFIG, "--sim", "1", "--hz", "20", cwd=ROOT) as (sock, _):
        for seed in [int(s) for s in a.seeds.split(",")]:
            job = f"{tag}-{seed}"
            r = train(a.script, "--socket", str(sock), "--job", job, "--seed", str(seed), *extra)
            with Client(sock) as c:
                rep = c.request("report", job=job)
            twin = None
            if not a.no_twin:
                ev = [f"abs:{e}" for e in r["event_at"] if e is not None]
                targs = list(extra)
                if "--event-at" in targs:
                    j = targs.index("--event-at")
                    del targs[j : j + 2]
                if ev:
                    targs += ["--event-at", ",".join(ev)]
                twin = train(a.script, "--no-greend", "--job", job + "-fp32", "--seed", str(seed), *targs)
            report(tag, seed, r, twin, rep)
            out = {"run": r, "twin": twin, "report": rep, "args": extra}
            (Path(a.out) / f"{job}.json").write_text(json.dumps(out, default=str))


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.2f}%"


def report(tag: str, seed: int, r: dict, twin: dict | None, rep: dict) -> None:
    """One run against its twin: the switch, rollbacks, end losses, saving (sim), upper %."""
    levels = r["levels"]
    n, own = len(levels), levels[0]
    sw = next((i for i, lv in enumerate(levels) if lv != own), None)
    rbs = [e for e in rep["precision_log"] if e["kind"] in ("rollback", "refused")]  # (refused: by its trial)
    saved_j, steps_j = (rep.get("savings") or {}).get("saved_j"), rep.get("sim_energy_j")
    saved = f"{100 * saved_j / (steps_j + saved_j):.1f}%" if isinstance(saved_j, (int, float)) and steps_j else "n/a"
    upper = "-"
    if sw is not None:
        trial = any(c.get("trial") for c in r.get("probe_checks") or [])
        start = max(0, sw - trial_start(0, 400)) if trial else sw
        end = max(i for i, lv in enumerate(levels) if lv != own) + 1
        upper = f"{100 * levels[start:end].count(own) / (n - start):.1f}%"
    low = sum(1 for lv in levels if lv != own)
    last = levels[-100:]
    final = max(set(last), key=last.count)
    keys = ("directive", "trial1", "down", "probe0", "probe4")
    sched = {k: v for k, v in (r.get("schedule") or {}).items() if k in keys}
    s = f"{tag} seed {seed}: switched {sw} (sched {sched}) events {r['event_at']}"
    s += f"\n   rollbacks {len(rbs)} final {final} bf16 steps {low}/{n} saved {saved} upper {upper}"
    if twin is not None:
        ev, tw = r["eval_loss"], twin["eval_loss"]
        s += f"\n   eval {ev:.5g} twin {tw:.5g} ({_pct(ev, tw)})"
        s += f"  as-run {tail(r):.5g} twin {tail(twin):.5g} ({_pct(tail(r), tail(twin))})"
        if "eval_bf16" in r and "eval_bf16" in twin:
            s += f"\n   eval@bf16 run {r['eval_bf16']:.5g} twin@bf16 {twin['eval_bf16']:.5g}"
            s += f" ({_pct(r['eval_bf16'], tw)} vs twin fp32)"
    print(s, flush=True)
    for e in rbs:
        print(
            f"   {'rollback' if e['kind'] == 'rollback' else 'turned down'} at step {e['step']}: {e['reason']}",
            flush=True,
        )
    for c in r.get("probe_checks") or []:
        if c.get("penalty") is None:
            print(f"     blk {c.get('start')} {c}", flush=True)
            continue
        kind = "T" if c.get("trial") else "P"
        print(
            f"     blk {c['start']} {kind} pen {c['penalty']:+.3f} se {c.get('se', 0):.3f} "
            f"move {c.get('move', 0):+.3f} shifted {c.get('shifted')} one-sided {c.get('one_sided')}",
            flush=True,
        )


if __name__ == "__main__":
    main()
