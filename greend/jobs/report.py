"""A job's figures: its energy (GPU from the ledger, the CPU share beside it), power,
FLOP/s and GFLOPS/W, over its life and over the last sliding window.

The accounting rules (which window, which joules, how the CPU share is made) are in
the docstring of :mod:`greend.jobs.registry`; this module only computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from greend.jobs.ledger import Ledger
from greend.jobs.records import Job
from greend.units import j_to_kwh

__all__ = ["ROW_FIELDS", "JobFigures", "rates", "savings_level"]

# The columns of a job's row in ``greenctl jobs`` and ``status`` (JobFigures.row).
ROW_FIELDS = (
    "job", "run_id", "state", "ranks", "gpus", "steps", "flops", "duration_s", "gpu_energy_j",
    "energy_j", "gflops_per_w", "saved_pct", "saved_gpu_energy_j", "sim", "precision", "world_size",
    "ranks_here", "started_at", "kind", "windows", "uid", "end_reason", "sent_before",
)  # fmt: skip

# Below this many baseline steps the saving is not estimated.
MIN_BASELINE_STEPS = 3
# A job's pace within this share of this node's own uncapped step is this node's own
# (the daemon pushes its step to the ranks again only once it moved more than 1 %).
PACE_MARGIN = 0.01


def savings_level(steps: int, rel_stderr: float | None) -> str:
    """How sure a saving is, from its baseline: ``high`` (>= 30 steps and the mean known
    within 1 %), ``medium`` (>= 8 steps, within 5 %), else ``low``."""
    if rel_stderr is None:
        return "low"
    if steps >= 30 and rel_stderr <= 0.01:
        return "high"
    if steps >= 8 and rel_stderr <= 0.05:
        return "medium"
    return "low"


def rates(flops: float, energy_j: float | None, span_s: float) -> tuple[float | None, float | None, float | None]:
    """Average power (W), FLOP/s and GFLOPS/W of ``flops`` run on ``energy_j`` over ``span_s``."""
    power = energy_j / span_s if energy_j is not None and span_s > 0 else None
    flop_per_s = flops / span_s if span_s > 0 else None
    return power, flop_per_s, (flops / energy_j / 1e9 if energy_j else None)


class JobFigures:
    """Computes a job's figures from the ledger; holds no job state of its own."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        hostname: str,
        window_s: float,
        grid_gco2_per_kwh: float,
        modelled_gpu: Callable[[int], bool],
        node_cpu_busy_s: Callable[[], float],
    ) -> None:
        self.ledger = ledger
        self.hostname = hostname
        self.window_s = window_s
        self.grid_gco2_per_kwh = grid_gco2_per_kwh
        self.modelled_gpu = modelled_gpu  # a device model executes GPU i's steps (its source: "sim")
        self.node_cpu_busy_s = node_cpu_busy_s  # the node's busy CPU seconds so far

    def gpu_energy(self, job: Job, t0: float, t1: float) -> float | None:
        total = 0.0
        known = False
        for g in sorted(job.gpus):
            e = self.ledger.energy_between(f"gpu{g}", t0, t1, clamp=True)
            if e is not None:
                total += e
                known = True
        return total if known else None

    def _cpu_energy(self, t0: float, t1: float) -> tuple[float | None, bool]:
        """The node's counted CPU energy (packages and dram; never core, uncore or psys),
        and whether any of it is the host probe's estimate rather than RAPL."""
        total = 0.0
        known = estimated = False
        for key in self.ledger.keys(prefix="cpu:", counted_only=True):
            e = self.ledger.energy_between(key, t0, t1, clamp=True)
            if e is not None:
                total += e
                known = True
                estimated |= key == "cpu:estimate"
        return (total if known else None), estimated

    def _per_gpu(self, job: Job, t0: float | None, t1: float | None, duration: float) -> list[dict[str, Any]]:
        """Each of the job's GPUs: its share of the FLOPs (a step's FLOPs split evenly over
        its rank's GPUs), its joules over the job's window, and what they make."""
        out = []
        for g in sorted(job.gpus):
            e = self.ledger.energy_between(f"gpu{g}", t0, t1, clamp=True) if t0 is not None and t1 is not None else None
            flops = job.gpu_flops.get(g, 0.0)
            power, flop_per_s, gflops_per_w = rates(flops, e, duration)
            out.append(
                {
                    "gpu": g,
                    "flops": flops,
                    "energy_j": e,
                    "avg_power_w": power,
                    "flop_per_s": flop_per_s,
                    "gflops_per_w": gflops_per_w,
                }
            )
        return out

    def window(self, job: Job, now_s: float) -> dict[str, Any]:
        t1 = now_s
        t0 = max(now_s - self.window_s, job.t_start_s or now_s)
        flops = sum(r.flops for r in job.recent if r.t1_s > t0 and r.t1_s <= t1)
        energy = self.gpu_energy(job, t0, t1)
        span = t1 - t0
        power, flop_per_s, gflops_per_w = rates(flops, energy, span)
        return {
            "window_s": span,
            "flops": flops,
            "gpu_energy_j": energy,
            "gpu_power_w": power,
            "flop_per_s": flop_per_s,
            "gflops_per_w": gflops_per_w,
        }

    def savings(self, job: Job, gpu_energy_j: float | None, duration_s: float) -> dict[str, Any]:
        """GPU energy saved against the job's own measured baseline: its steps uncapped at
        its own precision. The job's FLOPs at the baseline's joules (and seconds)
        per FLOP are what it would have cost without greend's controller; the saving is
        that less what it did cost, the slowdown its time over the baseline's.

        Where a device model executed the steps (simulated GPUs), both sides are the
        modelled steps' own energy and time; on real GPUs the ledger's joules over the
        baseline steps' windows and over the job's life (idle gaps included on both
        sides). How sure: the baseline's steps and the relative standard error of its
        mean (per-step joules per FLOP where modelled, seconds per FLOP on real GPUs),
        and a 95 % interval of the saving from it."""
        b = job.baseline
        modelled = job.modelled_energy_j > 0
        moved = job.cap_changes > 0 or any(e.kind in ("switch", "rollback") for e in job.precision_log)
        out: dict[str, Any] = {
            "baseline": {
                "setting": "uncapped",
                "precision": b.precision,
                "steps": b.steps,
                "joules_per_gflop": None,
            },
            "method": "sim: the simulated steps' own energy and time"
            if modelled
            else "the ledger's GPU joules over the baseline steps and over the job's life",
            "controlled": moved,
            "expected_gpu_energy_j": None,
            "gpu_energy_j": None,
            "saved_j": None,
            "saved_pct": None,
            "slowdown_pct": None,
            "reference": None,
            "confidence": {"level": "none", "rel_stderr": None, "saved_j_95": None},
            "note": None,
        }
        if b.steps < MIN_BASELINE_STEPS or b.flops <= 0 or job.flops <= 0:
            out["note"] = (
                f"no baseline: {b.steps} settled step(s) ran uncapped at {b.precision or 'its first precision'} "
                f"(at least {MIN_BASELINE_STEPS} with FLOPs needed)"
            )
            return out
        if modelled:
            base_e, actual_e = b.modelled_energy_j, job.modelled_energy_j
            base_t, actual_t = b.time_s, job.modelled_time_s
        else:
            parts = [self.gpu_energy(job, t0, t1) for t0, t1 in b.spans]
            known = [p for p in parts if p is not None]
            if not known or gpu_energy_j is None:
                out["note"] = "no baseline: the ledger has no GPU energy for the baseline steps"
                return out
            base_e, actual_e = sum(known), gpu_energy_j
            base_t, actual_t = sum(t1 - t0 for t0, t1 in b.spans), duration_s
        expected_e = base_e / b.flops * job.flops
        ref = self._reference(job, base_t, actual_t, modelled)
        expected_t, actual_t = ref["time_s"], ref["actual_time_s"]
        saved = expected_e - actual_e + (ref["wait_j"] or 0.0)
        rel_se = None
        mean = b.x_sum / b.x_n if b.x_n >= 2 else 0.0
        if mean > 0:  # (a sum of a few denormals over x_n is 0)
            var = max(0.0, (b.x_sq - b.x_n * mean * mean) / (b.x_n - 1))
            rel_se = (var / b.x_n) ** 0.5 / mean
        half = 1.96 * rel_se * expected_e if rel_se is not None else None
        if modelled and gpu_energy_j is not None:
            # The share is of the job's whole GPU energy (the ledger's: its steps and the
            # GPU's idle time between them), not of the steps' own: a job whose steps are
            # 1 % of its GPU energy saves at most 1 %. Without greend it would have used
            # what it used plus what was saved.
            actual_e = gpu_energy_j
            expected_e = gpu_energy_j + saved
        confidence: dict[str, Any] = {
            "level": savings_level(b.steps, rel_se),
            "rel_stderr": rel_se,
            "saved_j_95": [saved - half, saved + half] if half else None,
        }
        if modelled and (half is None or half < 0.05 + 1e-3 * abs(saved)):
            # The simulator's steps at one setting carry no noise: a 95 % interval of no
            # width says nothing, so none is given.
            confidence = {"level": "sim", "rel_stderr": None, "saved_j_95": None}
        out["baseline"]["joules_per_gflop"] = base_e / b.flops * 1e9
        out.update(
            {
                "expected_gpu_energy_j": expected_e,
                "gpu_energy_j": actual_e,
                "saved_j": saved,
                "saved_pct": 100.0 * saved / expected_e if expected_e > 0 else None,
                "slowdown_pct": 100.0 * (actual_t / expected_t - 1.0) if expected_t > 0 else None,
                "reference": ref,
                "confidence": confidence,
            }
        )
        if not moved:
            out["note"] = "greend's controller did not move this job: it ran at its baseline throughout"
        return out

    def _reference(self, job: Job, base_t: float, actual_t: float, modelled: bool) -> dict[str, Any]:
        """What the job's time (and, paced, its GPUs' wait) is judged against: the time it
        would have run under policy ``none``. That is this node's uncapped step, unless
        the job's pace (agreed across nodes, ``pace_s``) is slower: then a slower node
        sets it, and under ``none`` this node's GPUs would have run uncapped and waited
        for it. Where a device model executed the steps, the node's time is its slowest
        GPU's (its critical path): a GPU paced to a slower one on the node is judged
        against that pace too.

        ``wait_j``: the energy this node's GPUs would have spent waiting for the pace
        under ``none`` beyond what they waited paced, at the power they drew outside
        their steps (the ledger's joules less the modelled steps' over the time outside
        them); None where that power is not known or nothing waits. On real GPUs the
        baseline's joules are the ledger's over the baseline steps' windows, their
        waits included, so no term is added."""
        b = job.baseline
        own_t = base_t / b.flops * job.flops
        per_gpu_own: dict[int, float] = {}
        if modelled and b.gpu_flops and job.gpu_modelled_s:
            per_gpu_own = {
                g: b.gpu_modelled_s[g] / f * job.gpu_flops.get(g, 0.0) for g, f in b.gpu_flops.items() if f > 0
            }
            if per_gpu_own:
                own_t = max(per_gpu_own.values())
                actual_t = max(job.gpu_modelled_s.values())
        ranks = max(1, len(job.ranks_seen))
        # The job's FLOPs per step on one rank (as the policy converts the pace: per FLOP).
        step_flops = b.flops / b.steps
        steps = job.flops / ranks / step_flops
        own_step_s = own_t / steps if steps > 0 else None
        pace = job.pace_s if job.pace_s is not None and job.pace_s > 0 else None
        by_pace = pace is not None and own_step_s is not None and pace > own_step_s * (1.0 + PACE_MARGIN)
        expected_t = pace * steps if by_pace and pace is not None else own_t
        wait_j = None
        if by_pace:
            # Paced, the node's GPUs still wait for the slower node where their steps
            # took less than its pace: the job ran at the pace, not faster.
            job_t = max(actual_t, expected_t)
            t0, t1, duration = self._span(job)
            gpu_e = self.gpu_energy(job, t0, t1) if t0 is not None and t1 is not None else None
            outside_s = duration * len(job.gpus) - sum(job.gpu_modelled_s.values())
            if per_gpu_own and gpu_e is not None and outside_s > 0.01 * duration * len(job.gpus):
                wait_w = max(0.0, gpu_e - job.modelled_energy_j) / outside_s
                none_wait_s = sum(max(0.0, expected_t - t) for t in per_gpu_own.values())
                paced_wait_s = sum(max(0.0, job_t - job.gpu_modelled_s.get(g, 0.0)) for g in per_gpu_own)
                wait_j = wait_w * (none_wait_s - paced_wait_s)
            actual_t = job_t
        if by_pace:
            label = "the job's pace (a slower node sets it)"
        elif pace is not None:
            label = "the job's pace (this node sets it: its uncapped step)"
        else:
            label = "this node's uncapped step" + (" (its slowest GPU's)" if len(per_gpu_own) > 1 else "")
        return {
            "kind": "job_pace" if by_pace else "node_uncapped",
            "label": label,
            "pace_s": pace,
            "node_uncapped_step_s": own_step_s,
            "time_s": expected_t,
            "actual_time_s": actual_t,  # paced: the job's time here (its steps', or the pace's)
            "wait_j": wait_j,
        }

    def _span(self, job: Job) -> tuple[float | None, float | None, float]:
        """The job's life so far: (first step, last reading or step, seconds)."""
        t0 = job.t_start_s
        t1: float | None
        if job.t_end_s is not None:
            t1 = job.t_end_s
        else:
            t1 = max(self.ledger.last_time(f"gpu{g}") or 0.0 for g in job.gpus) if job.gpus else None
            if t1 is None or t1 == 0.0:
                t1 = job.last_step_t1_s
        return t0, t1, (t1 - t0) if (t0 is not None and t1 is not None) else 0.0

    def _energies(
        self, job: Job, t0: float | None, t1: float | None, gpu_e: float | None
    ) -> tuple[float | None, str, float | None, float]:
        """(the job's CPU joules, how they were got, the node's CPU joules, GPU + CPU)."""
        node_cpu_e, estimated = self._cpu_energy(t0, t1) if t0 is not None and t1 is not None else (None, False)
        # "unmeasured": no RAPL zone was readable and no cpu_tdp_w estimate is configured,
        # so the 0 J beside it is not a measurement.
        cpu_e, cpu_method = node_cpu_e, "node" if node_cpu_e is not None else "unmeasured"
        if node_cpu_e is not None and job.cpu_busy0_s is not None:
            node_busy = self.node_cpu_busy_s() - job.cpu_busy0_s
            if node_busy > 0:
                cpu_e = node_cpu_e * min(1.0, job.cpu_job_s / node_busy)
                cpu_method = "process_share"
        if estimated:
            cpu_method += ", estimate"
        return cpu_e, cpu_method, node_cpu_e, (gpu_e or 0.0) + (cpu_e or 0.0)

    def row(self, job: Job) -> dict[str, Any]:
        """The figures ``greenctl jobs`` and ``status`` list (a subset of :meth:`report`),
        computed without the rest: a node's status lists every job."""
        if job.summary is not None:
            r = job.summary
            return {k: r.get(k) for k in ROW_FIELDS}
        t0, t1, duration = self._span(job)
        gpu_e = self.gpu_energy(job, t0, t1) if t0 is not None and t1 is not None else None
        _, _, _, energy = self._energies(job, t0, t1, gpu_e)
        saving = self.savings(job, gpu_e, duration)
        return {
            "job": job.job,
            "run_id": job.run,
            "state": job.state,
            "ranks": len(job.ranks),
            "gpus": sorted(job.gpus),
            "steps": job.steps,
            "flops": job.flops,
            "duration_s": duration,
            "gpu_energy_j": gpu_e or 0.0,
            "energy_j": energy,
            "gflops_per_w": job.flops / gpu_e / 1e9 if gpu_e and job.flops else None,
            "saved_pct": saving["saved_pct"],
            "saved_gpu_energy_j": saving["saved_j"],
            "sim": job.modelled_energy_j > 0,  # the GPU figures are the simulator's
            "precision": job.precision,
            "world_size": job.world_size,
            "ranks_here": len(job.ranks_seen),
            "started_at": job.registered_wall_s,
            "uid": job.uid,  # whose run (the Slurm Epilog saves only its job owner's)
            "end_reason": job.end_reason,  # (a run that goes on in a later record: greend.jobs.parts)
            "sent_before": job.steps_before,
        } | _kind_fields(job)

    def report(self, job: Job) -> dict[str, Any]:
        """The job's figures over its life (so far, while it runs)."""
        if job.summary is not None:
            return job.summary
        t0, t1, duration = self._span(job)
        per_gpu = self._per_gpu(job, t0, t1, duration)
        known = [g["energy_j"] for g in per_gpu if g["energy_j"] is not None]
        gpu_e = sum(known) if known else None  # the job's GPUs' joules, as gpu_energy sums them
        cpu_e, cpu_method, node_cpu_e, energy = self._energies(job, t0, t1, gpu_e)
        co2 = j_to_kwh(energy) * self.grid_gco2_per_kwh if energy else 0.0
        sources = sorted({"sim" if self.modelled_gpu(g) else "nvml" for g in job.gpus})
        saving = self.savings(job, gpu_e, duration)
        ref = saving["reference"]
        for g in per_gpu:
            t = job.gpu_modelled_s.get(g["gpu"])
            g["sim_time_s"] = t
            # Each GPU's time against the job's: at or under 0 it kept the pace.
            g["slowdown_pct"] = 100.0 * (t / ref["time_s"] - 1.0) if t is not None and ref and ref["time_s"] else None
        return (
            {
                "job": job.job,
                "run_id": job.run,
                "state": job.state,
                "end_reason": job.end_reason,
                "uid": job.uid,
                "host": self.hostname,
                "started_at": job.registered_wall_s,
                # The first step on the wall clock (where a plot's time axis starts).
                "first_step_at": job.registered_wall_s + (t0 - job.registered_s) if t0 is not None else None,
                "ranks": len(job.ranks),
                # The job's size across nodes and its ranks here: a job with ranks elsewhere
                # gets a partial figure from this node (greenctl report --store A --store B sums).
                "world_size": job.world_size,
                "ranks_here": len(job.ranks_seen),
                "ranks_gone": [g.to_json() for g in job.gone],
                "gpus": sorted(job.gpus),
                # Each claim's state (greend.jobs.claims): "pending" GPUs show none of the
                # job's processes and are never steered for it.
                "gpu_claims": {str(g): job.claims[g] for g in sorted(job.claims)},
                "gpu_source": ",".join(sources) if sources else None,
                "steps": job.steps,
                "step_reports": job.step_reports,
                "sent_before": job.steps_before,  # (sent before this record began: greend.jobs.parts)
                "flops": job.flops,
                "samples": job.samples,
                "tokens": job.tokens,
                "duration_s": duration,
                "window": {"t0_s": t0, "t1_s": t1},
                "gpu_energy_j": gpu_e or 0.0,
                "cpu_energy_j": cpu_e or 0.0,
                "cpu_energy_method": cpu_method,
                "node_cpu_energy_j": node_cpu_e or 0.0,
                "energy_j": energy,
                "energy_kwh": j_to_kwh(energy),
                "avg_power_w": energy / duration if duration > 0 else None,
                "avg_gpu_power_w": (gpu_e or 0.0) / duration if duration > 0 else None,
                "flop_per_s": job.flops / duration if duration > 0 else None,
                "gflops_per_w": job.flops / gpu_e / 1e9 if gpu_e and job.flops else None,  # None: FLOPs unknown
                "gflops_per_w_with_cpu": job.flops / energy / 1e9 if energy and cpu_e is not None else None,
                "gflops_per_w_busy": job.flops / job.modelled_energy_j / 1e9 if job.modelled_energy_j else None,
                "gpu_energy_per_step_j": gpu_e / job.steps if gpu_e is not None and job.steps else None,
                "per_gpu": per_gpu,
                # The last [report] window_s of a running job (its last window once it ended).
                "recent": self.window(job, t1) if t1 is not None else None,
                "samples_per_j": job.samples / energy if energy else None,
                "tokens_per_j": job.tokens / energy if energy else None,
                "co2_g": co2,
                "co2_method": f"estimate: {self.grid_gco2_per_kwh:g} gCO2/kWh configured grid intensity",
                "last_loss": job.last_loss,
                "nonfinite_steps": job.nonfinite_steps,
                # Steps run at the level above the job's to judge it (probes): energy not saved.
                "probe_steps": job.probe_steps,
                "step_time_s": job.step_time_s,
                # The figures of the steps a device model executed, under the names users know.
                "sim_time_s": job.modelled_time_s if job.modelled_time_s else None,
                "sim_energy_j": job.modelled_energy_j if job.modelled_energy_j else None,
                "sim": job.modelled_energy_j > 0,  # the GPU figures are the simulator's
                "precision": job.precision,
                "top_precision": job.top_precision,  # the job's own level: greend never goes above
                # A level the daemon proposed that the ranks have not applied (None: none stands).
                "proposed_precision": job.proposal.level if job.proposal is not None else None,
                "precision_log": [e.to_json() for e in job.precision_log],
                "pace_s": job.pace_s,
                "floor_s": job.floor_s,  # the fastest uncapped step a node measured, agreed with the pace
                "decisions": [d.to_json() for d in job.decisions[-50:]],
                "cap_changes": job.cap_changes,
                # Each policy's latest word on the job: why it is (or was) capped or not,
                # switched or not.
                "notes": list(job.notes.values()),
                "savings": saving,
                # Flat copies for the stores' job summary (greend_job).
                "saved_gpu_energy_j": saving["saved_j"],
                "saved_pct": saving["saved_pct"],
                "slowdown_pct": saving["slowdown_pct"],
            }
            | _kind_fields(job)
        )


def _kind_fields(job: Job) -> dict[str, Any]:
    """What a job's kind changes in its row and report: a command measured whole
    (``greenctl measure``) has no steps and no precision of its own; the windows it
    reported its time in are ``windows``, never steps."""
    if job.kind != "measure":
        return {"kind": job.kind, "windows": None}
    return {
        "kind": "measure",
        "measured_whole": True,
        "windows": job.steps,
        "steps": None,
        "step_reports": None,
        "gpu_energy_per_step_j": None,
        "precision": None,
        "top_precision": None,
        "proposed_precision": None,
    }
