"""How ranks meet without a collective: job ids from the launcher, and the pace
agreed through the job's rendezvous store."""

from __future__ import annotations

import datetime
import itertools
import random
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from greend.training.identity import resolve_job, resolve_run  # noqa: E402
from greend.training.peers import JobPeers  # noqa: E402
from tests.support import wait_for  # noqa: E402

LAUNCH_VARS = ("GREEND_JOB", "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_the_tasks_of_one_srun_step_are_the_ranks_of_one_run_without_a_process_group(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """srun sets SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID, not RANK: two tasks of step
    0 of job 777 are ranks 0 and 1 of 2, of one job and one run. A batch script's own
    process (no SLURM_STEP_NUM_TASKS) is one process, whatever --ntasks says."""
    from greend.training.identity import resolve_ranks, resolve_run

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GREEND_RUN", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT",
                "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):  # fmt: skip
        clean_env.delenv(var, raising=False)
    clean_env.setenv("SLURM_JOB_ID", "777")
    clean_env.setenv("SLURM_STEP_ID", "0")
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "2")
    seen = []
    for task in (0, 1):
        clean_env.setenv("SLURM_PROCID", str(task))
        clean_env.setenv("SLURM_LOCALID", str(task))
        rank, local, world = resolve_ranks()
        seen.append((rank, local, world, resolve_job(None), resolve_run(resolve_job(None), world)))
    assert [s[:3] for s in seen] == [(0, 0, 2), (1, 1, 2)]
    assert seen[0][3:] == seen[1][3:] and seen[0][3] == "777.0"
    clean_env.delenv("SLURM_STEP_NUM_TASKS")
    clean_env.setenv("SLURM_NTASKS", "4")  # (sbatch --ntasks=4: the batch script is one process)
    assert resolve_ranks() == (0, 0, 1)
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "2")
    clean_env.setenv("RANK", "5")  # a launcher's RANK wins over Slurm's
    clean_env.setenv("WORLD_SIZE", "8")
    assert resolve_ranks()[::2] == (5, 8)


def test_one_elastic_attempt_has_one_run_id_on_every_node(clean_env: pytest.MonkeyPatch) -> None:
    """After a failure on node A, its agent counts TORCHELASTIC_RESTART_COUNT up; node B's,
    whose workers restarted only for A's, does not. The count was in the run id's digest:
    one attempt had a run id per node, and B's matched the attempt before. Without a
    process group, the ranks of one rendezvous get one run id whatever their counts."""
    from greend.training.identity import resolve_run

    for var in ("GREEND_RUN", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        clean_env.delenv(var, raising=False)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "train-42")
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    clean_env.setenv("MASTER_PORT", "29500")
    runs = []
    for count in ("1", "0"):  # node A, node B, in the same attempt
        clean_env.setenv("TORCHELASTIC_RESTART_COUNT", count)
        runs.append(resolve_run("train-42", 2))
    assert runs[0] == runs[1]


def test_a_second_fit_in_one_process_group_is_a_new_run(clean_env: pytest.MonkeyPatch) -> None:
    """A second ``fit()``/``train()`` under DDP made callbacks on every rank that read the
    first run's id back from the group's store: the report showed the second run alone, with
    no word of the first. Each run of the job has a key of its own in the store now."""
    clean_env.delenv("GREEND_RUN", raising=False)
    store = dist.HashStore()
    first = [resolve_run("ddp-refit", 2, store) for _rank in range(2)]
    second = [resolve_run("ddp-refit", 2, store) for _rank in range(2)]
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]


def test_torchrun_without_a_run_id_is_named_by_its_rendezvous(clean_env: pytest.MonkeyPatch) -> None:
    # torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none for every job: two jobs
    # on one node must not merge into a job "none".
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "29500")
    first = resolve_job(None)
    clean_env.setenv("MASTER_PORT", "29617")
    second = resolve_job(None)
    assert first == "torchrun-127.0.0.1-29500" and second == "torchrun-127.0.0.1-29617"
    # Slurm's id wins over the rendezvous; a real run id is used as it is.
    clean_env.setenv("SLURM_JOB_ID", "981")
    assert resolve_job(None) == "981"
    # Under srun, the step too (Slurm's JOBID.STEP): two sruns of one allocation are two runs.
    clean_env.setenv("SLURM_STEP_ID", "2")
    assert resolve_job(None) == "981.2"
    clean_env.setenv("SLURM_STEP_ID", "batch")  # not a number: the job id alone
    assert resolve_job(None) == "981"
    clean_env.delenv("SLURM_STEP_ID")
    clean_env.delenv("SLURM_JOB_ID")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "my-run")
    assert resolve_job(None) == "my-run"


def test_none_without_a_rendezvous_falls_back_to_this_process(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TORCHELASTIC_RUN_ID", "None")
    job = resolve_job(None)
    assert job.lower() != "none" and "-" in job


def test_ranks_agree_on_the_max_of_the_previous_epoch() -> None:
    store = dist.HashStore()
    peers = [JobPeers(store, "j", rank) for rank in range(3)]
    # Epoch 1: every rank writes; nothing agreed yet (epoch 0 had no figures).
    assert [p.agree_max("pace", 1, v) for p, v in zip(peers, (0.10, 0.30, 0.20))] == [None] * 3
    # Epoch 2: each reads epoch 1's MAX, whatever order they come in; a rank with no
    # figure (its daemon away) adds nothing and still reads the agreement.
    assert peers[2].agree_max("pace", 2, 0.25) == pytest.approx(0.30)
    assert peers[0].agree_max("pace", 2, None) == pytest.approx(0.30)
    assert peers[1].agree_max("pace", 2, 0.12) == pytest.approx(0.30)
    assert peers[1].agree_max("pace", 3, 0.12) == pytest.approx(0.25)
    # Rank 0 deletes keys two epochs old: the store does not grow with the run.
    peers[0].agree_max("pace", 4, 0.1)
    assert not store.check(["greend/j/pace/2"]) and store.check(["greend/j/pace/3"])


def test_ranks_agree_the_pace_max_and_the_floor_min_of_the_previous_epoch_in_one_key() -> None:
    store = dist.HashStore()
    peers = [JobPeers(store, "j", rank) for rank in range(3)]
    figures = ((0.20, 0.18), (0.10, 0.09), (0.30, None))  # (rank 2's daemon has no floor)
    assert [p.agree_pace(1, *f) for p, f in zip(peers, figures)] == [(None, None, 0)] * 3
    assert peers[2].agree_pace(2, 0.25, 0.24) == pytest.approx((0.30, 0.09, 0))
    assert peers[0].agree_pace(2, None, None) == pytest.approx((0.30, 0.09, 0))  # (no figures: reads only)
    assert peers[1].agree_pace(2, 0.12, None) == pytest.approx((0.30, 0.09, 0))
    assert peers[1].agree_pace(3, 0.11, None) == (pytest.approx(0.25), pytest.approx(0.24), 0)
    assert store.check(["greend/j/paces/2"]) and not store.check(["greend/j/floor/2"])  # (one key an epoch)
    peers[0].agree_pace(4, 0.1, None)
    assert not store.check(["greend/j/paces/2"]) and store.check(["greend/j/paces/3"])  # (rank 0 cleans up)
    JobPeers(store, "k", 0).agree_pace(1, 0.3, None)
    assert JobPeers(store, "k", 1).agree_pace(2, None, None) == (pytest.approx(0.3), None, 0)  # (no rank had a floor)


def test_a_re_check_a_node_asks_is_agreed_as_the_max_in_the_same_key() -> None:
    store = dist.HashStore()
    peers = [JobPeers(store, "j", rank) for rank in range(3)]
    peers[0].agree_pace(1, 0.20, 0.18)  # (an ask of none: the key as a rank of an earlier release writes it)
    assert store.get("greend/j/paces/1").decode() == "0.2,0.18"
    peers[1].agree_pace(1, 0.10, None, 2106)
    peers[2].agree_pace(1, 0.30, 0.17, 1500)
    assert peers[0].agree_pace(2, 0.2, 0.18) == (pytest.approx(0.30), pytest.approx(0.17), 2106)
    JobPeers(store, "k", 0).agree_pace(1, 0.3, None, 7)
    assert JobPeers(store, "k", 1).agree_pace(2, None, None) == (pytest.approx(0.3), None, 7)


def _eight_ranks_on_a_tcp_store(work) -> dist.TCPStore:  # type: ignore[no-untyped-def]
    """``work(peers, i)`` run by 8 threads at once, each rank ``i`` on its own client of one
    TCPStore; returns the server's store, once they are done."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))

    def rank(i: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10))
        work(JobPeers(client, "j", i), i)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return server


def test_concurrent_ranks_on_a_tcp_store_agree_the_pace_and_floor() -> None:
    paces = [0.01 * (i + 1) for i in range(8)]

    def work(peers: JobPeers, i: int) -> None:
        for _ in range(10):
            peers.agree_pace(1, paces[i], 0.5 - paces[i])

    server = _eight_ranks_on_a_tcp_store(work)
    assert JobPeers(server, "j", 1).agree_pace(2, None, None) == pytest.approx((max(paces), 0.5 - max(paces), 0))


def test_concurrent_ranks_on_a_tcp_store_raise_to_the_max() -> None:
    values = [0.01 * (i + 1) for i in range(8)]

    def work(peers: JobPeers, i: int) -> None:
        for _ in range(20):
            peers.raise_to("pace", 1, values[i])

    server = _eight_ranks_on_a_tcp_store(work)
    assert JobPeers(server, "j", 0).read("pace", 1) == pytest.approx(max(values))


def _directive(cb, level: str) -> None:  # type: ignore[no-untyped-def]
    """What the sender does when the daemon's directive arrives."""
    cb._channel.requested = level
    cb._channel.on_directive()


def _ranked_callbacks(monkeypatch: pytest.MonkeyPatch, sock_path, store, n: int = 2, model=None, **kw):  # type: ignore[no-untyped-def]
    """n callbacks in one process standing for the ranks of one job, meeting in ``store``
    (``model``: makes each rank's model, else a small linear layer; ``kw``: GreenCallback's
    options over these)."""
    from greend.training.callback import GreenCallback

    options = {"precisions": ["fp32", "bf16"], "sync_every": 5, "flush_interval_s": 0.02, "heartbeat_s": 0.2, **kw}
    cbs = []
    for rank in range(n):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(n))
        net = model() if model is not None else torch.nn.Linear(4, 2)
        cb = GreenCallback(job="agree", model=net, socket=sock_path, **options)
        cb._control.peers = JobPeers(store, "agree", rank)
        cbs.append(cb)
    return cbs


def _three_levels(monkeypatch: pytest.MonkeyPatch, sock_path, store, sync_every: int = 5):  # type: ignore[no-untyped-def]
    """Two ranks of an fp32 job that may go down to bf16 and fp8 (no spike rule, no trial)."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))

    return _ranked_callbacks(monkeypatch, sock_path, store, model=model, initial_precision="fp32",
                             precisions=["fp32", "bf16", "fp8-emulated"], sync_every=sync_every, fp8_min_features=16,
                             spike_tolerance=None, probe_trial=False)  # fmt: skip


DOWN_TO_FP8 = {7: [(0, "bf16"), (1, "bf16")], 300: [(0, "fp8-emulated"), (1, "fp8-emulated")]}  # both daemons ask


def _fp8_worse(monkeypatch, sock_path, steps: int, nan_at: int | None, sync_every: int = 5):  # type: ignore[no-untyped-def]
    """:func:`_three_levels` down to fp8, which fares 15 % worse on both ranks (their probes
    roll it back together); rank 0's loss non-finite at ``nan_at``. (levels ran, callbacks)"""
    cbs = _three_levels(monkeypatch, sock_path, dist.HashStore(), sync_every)
    rng = random.Random(3)
    noise = [[1.0 + rng.gauss(0, 0.02) for _ in range(steps)] for _ in range(2)]

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        if r == 0 and i == nan_at:
            return float("nan")
        return noise[r][i] * (1.15 if cbs[r]._book.precision == "fp8-emulated" else 1.0)

    return _lockstep(cbs, steps, DOWN_TO_FP8, loss), cbs


def _lockstep(cbs, steps: int, asks: dict[int, list[tuple[int, str]]], loss=None) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """``steps`` steps of the ranks in lockstep, as DDP keeps them: before step i, each
    ``(rank, level)`` of ``asks[i]`` is that rank's daemon's directive; ``loss(r, i, ran)``
    the loss rank r reports at step i (1.0). The level each rank ran at each step; the
    callbacks are closed after."""
    ran: list[list[str]] = [[] for _ in cbs]
    try:
        for i in range(steps):
            for r, level in asks.get(i, []):
                _directive(cbs[r], level)
            for r, cb in enumerate(cbs):
                with cb.step(samples=1) as st:
                    st.loss(torch.tensor(1.0 if loss is None else loss(r, i, ran)))
                ran[r].append(st.precision)
    finally:
        for cb in cbs:
            cb.close()
    return ran


def test_ranks_switch_precision_at_the_same_step_once_every_daemon_asks(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path
) -> None:  # type: ignore[no-untyped-def]
    """Rank 0's daemon asks for bf16 at step 7, rank 1's at step 23: nobody switches
    before both asked, and both switch at the same step. Then rank 1's daemon asks for
    fp32 again (a rollback): both go back at the same step, and rank 0 tells its daemon."""
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore(), probe_trial=False)
    ran = _lockstep(cbs, 70, {7: [(0, "bf16")], 23: [(1, "bf16")], 45: [(1, "fp32")]})
    assert ran[0] == ran[1], "the ranks ran different precisions at some step"
    first_low = ran[0].index("bf16")
    assert 23 < first_low <= 23 + 2 * 5 + 1, first_low  # within two agreement epochs of the last ask
    back = first_low + ran[0][first_low:].index("fp32")
    assert 45 < back <= 45 + 2 * 5 + 1, back
    assert all(p == "bf16" for p in ran[0][first_low:back]) and all(p == "fp32" for p in ran[0][back:])
    rollbacks = [e for e in cbs[0].precision_events if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and "another rank" in rollbacks[0]["reason"], cbs[0].precision_events


def test_ranks_run_a_step_down_s_trial_at_the_same_steps(monkeypatch: pytest.MonkeyPatch, daemon, sock_path) -> None:  # type: ignore[no-untyped-def]
    """A step down starts with a trial (greend.training.probe): fp32 but for TRIAL_BLOCKS
    blocks of bf16, then bf16 but for the probe blocks. Every rank runs it at the same
    steps (its blocks are drawn from the step the ranks agreed on), so DDP never averages
    the gradients of two levels' steps."""
    from greend.training.probe import PROBE_STEPS, TRIAL_BLOCKS

    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore())
    ran = _lockstep(cbs, 260, {7: [(0, "bf16"), (1, "bf16")]})
    assert ran[0] == ran[1], "the ranks ran different precisions at some step"
    runs = [(lvl, len(list(g))) for lvl, g in itertools.groupby(ran[0])]
    low = [n for lvl, n in runs if lvl == "bf16"]
    assert low[:TRIAL_BLOCKS] == [PROBE_STEPS] * TRIAL_BLOCKS, runs
    probes = [n for lvl, n in runs[2 * TRIAL_BLOCKS + 1 : -1] if lvl == "fp32"]  # (the last may be cut short)
    assert probes and set(probes) == {PROBE_STEPS}, runs  # then bf16, but for the probe blocks
    assert ran[0][-1] == "bf16" and not [e for e in cbs[0].precision_events if e["kind"] == "rollback"]


def test_ranks_that_read_their_losses_at_other_times_run_the_trial_and_go_down_together(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path
) -> None:  # type: ignore[no-untyped-def]
    """Without the spike rule a rank reads its losses in batches of 16, or at each step's
    end when its timer says so (as GPU reads land at other times on other ranks): rank 0
    reads late, rank 1 at once. The trial's second block and the step the run goes down
    are placed READ_LAG steps clear of the reads, so both ranks run every step at the same
    level, the probe blocks after the trial included (they are drawn from the step the
    run went down)."""
    torch.set_num_threads(1)
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore(), spike_tolerance=None)
    cbs[0]._book.judge_within_s = 1e9  # (the count only: every 16 steps)
    cbs[1]._book.judge_within_s = 0.0  # (every step's end)
    ran = _lockstep(cbs, 400, {7: [(0, "bf16"), (1, "bf16")]})
    assert [i for i in range(400) if ran[0][i] != ran[1][i]] == [], list(itertools.groupby(ran[0]))
    assert ran[0].count("bf16") > 200  # (it went down, and stayed)


def test_a_rank_that_rolled_back_is_not_taken_down_again_by_the_words_written_before(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path
) -> None:  # type: ignore[no-untyped-def]
    """Both daemons ask bf16, the ranks switch together; a few steps later rank 1's loss is
    NaN and it rolls back (bf16 barred). The next agreement reads the words both ranks
    wrote before that (bf16): rank 1 went down again at once and its rollback was lost,
    rank 0 never went up. Now rank 1 stays up and its word takes rank 0 up too."""
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore())

    def loss(r: int, i: int, ran: list[list[str]]) -> float:  # rank 1's NaN, 2 steps after both switched
        return float("nan") if r == 1 and "bf16" in ran[0] and i == ran[0].index("bf16") + 2 else 1.0

    ran = _lockstep(cbs, 80, {3: [(0, "bf16"), (1, "bf16")]}, loss)
    first_low = ran[0].index("bf16")
    assert ran[1][first_low] == "bf16"
    back = [first_low + ran[r][first_low:].index("fp32") for r in (0, 1)]
    assert back[1] <= first_low + 4, ran[1]  # rolled back after its NaN, the next step or the one after
    assert back[0] <= back[1] + 2 * 5 + 1, ran[0]  # taken up within two agreement epochs
    for r in (0, 1):
        assert set(ran[r][back[r] :]) == {"fp32"}, ran[r]  # never down again while bf16 is barred
    # (the ranks' first bf16 steps are the step down's trial: rank 0 follows rank 1's refusal)
    assert any(e["kind"] == "refused" and "another rank" in e["reason"] and e["to"] == "bf16"
               for e in cbs[0].precision_events), cbs[0].precision_events  # fmt: skip


def test_ranks_whose_daemons_ask_different_levels_run_the_agreed_one_together(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path
) -> None:  # type: ignore[no-untyped-def]
    """Node 0's daemon asks bf16, node 1's fp16 (below it): the ranks agree on the more
    precise, bf16, and both run it. A rank took the agreed level down only when it was
    the very one it proposed: rank 1 stayed at fp32 for good while rank 0 ran bf16."""
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore(), precisions=["fp32", "bf16", "fp16"],
                            loss_scaling=True, probe_trial=False)  # fmt: skip
    ran = _lockstep(cbs, 40, {3: [(0, "bf16"), (1, "fp16")]})
    assert ran[0] == ran[1], ran  # (the probe blocks at fp32 too, at the same steps)
    assert "fp16" not in ran[0] and ran[0].count("bf16") >= 20, ran[0]


def test_a_rank_alone_applies_its_directive_at_once(monkeypatch: pytest.MonkeyPatch, daemon, sock_path) -> None:  # type: ignore[no-untyped-def]
    """Several ranks but no store to meet in (no process group): each rank follows its own
    daemon, as before."""
    from greend.training.callback import GreenCallback

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cb = GreenCallback(job="alone", model=torch.nn.Linear(4, 2), socket=sock_path, precisions=["fp32", "bf16"],
                       initial_precision="fp32", sync_every=5, flush_interval_s=0.02, probe_trial=False)  # fmt: skip
    ran = []
    try:
        for i in range(12):
            if i == 2:
                _directive(cb, "bf16")
            with cb.step(samples=1) as st:
                st.loss(torch.tensor(1.0))
            ran.append(st.precision)
    finally:
        cb.close()
    # The first step's agreement found no process group: the directive at step 2 applies at once.
    assert cb._control.agreeing is False
    assert ran == ["fp32"] * 2 + ["bf16"] * 10, ran


def test_ranks_of_a_bf16_job_stay_at_bf16_while_they_agree(monkeypatch: pytest.MonkeyPatch, daemon, sock_path) -> None:  # type: ignore[no-untyped-def]
    """Two ranks of a job that trains in bf16 with its own autocast inside the step: the
    first steps, before greend has seen the job's level, say nothing of it; the ranks
    never move the job up to fp32 (nor flip back and forth), and report no rollback."""
    from greend.training.callback import GreenCallback

    store = dist.HashStore()
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    cbs = []
    for rank, model in enumerate(models):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        cb = GreenCallback(job="own-bf16", model=model, socket=sock_path, sync_every=5, flush_interval_s=0.02)
        cb._control.peers = JobPeers(store, "own-bf16", rank)
        cbs.append(cb)
    ran: list[list[str]] = [[], []]
    try:
        for _ in range(40):
            for r, (cb, model) in enumerate(zip(cbs, models)):  # the ranks in lockstep
                with cb.step(samples=1) as st:
                    with torch.autocast("cpu", dtype=torch.bfloat16):  # the job's own level
                        out = model(torch.randn(3, 4))
                    st.loss(out.float().pow(2).mean())
                ran[r].append(st.precision)
    finally:
        for cb in cbs:
            cb.close()
    for r in (0, 1):
        assert cbs[r]._control.own == "bf16"
        assert set(ran[r][1:]) == {"bf16"}, ran[r]
        assert cbs[r].precision_events == [], cbs[r].precision_events


def test_ranks_started_without_torchrun_share_the_rendezvous_s_name(clean_env: pytest.MonkeyPatch) -> None:
    """A Kubeflow PyTorchJob's pods (or mpirun's ranks) get MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE and RANK but no torchrun variables: each pod named its own job
    (<pod>-<pid>-<time>), and no whole-job report could join them."""
    clean_env.setenv("MASTER_ADDR", "bert-ft-master-0")
    clean_env.setenv("MASTER_PORT", "23456")
    clean_env.setenv("WORLD_SIZE", "2")
    named = set()
    for rank in ("0", "1"):
        clean_env.setenv("RANK", rank)
        named.add(resolve_job(None))
    assert named == {"dist-bert-ft-master-0-23456"}
    clean_env.setenv("WORLD_SIZE", "1")  # one process told a rendezvous: not named by it
    assert not resolve_job(None).startswith("dist-")


def test_an_id_from_the_environment_that_is_rewritten_says_so(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """GREEND_JOB="my job" was booked as my-job, and GREEND_RUN cut to 64 characters, without
    a word: `greenctl report "my job"` then found nothing."""
    clean_env.setenv("GREEND_JOB", "my job")
    clean_env.setenv("GREEND_RUN", "bad run!")
    with caplog.at_level("WARNING"):
        assert resolve_job(None) == "my-job"
        assert resolve_run("my-job", 1) == "bad-run-"
    assert "'my job', is booked as 'my-job'" in caplog.text and "GREEND_RUN='bad run!' is booked as run" in caplog.text


def _step_ranks(cbs: list[Any], rounds: int = 20) -> None:
    """Each rank steps ``rounds`` times, 20 ms apart: the senders, every 20 ms, agree each
    epoch as it comes."""
    for _ in range(rounds):
        for cb in cbs:
            with cb.step(samples=1) as st:
                st.loss(torch.tensor(1.0))
        time.sleep(0.02)


def test_ranks_agree_the_jobs_floor_with_its_pace_and_tell_their_daemon(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path
) -> None:  # type: ignore[no-untyped-def]
    """Each rank's daemon pushes its node's uncapped step and the lowest it measured
    (``local_pace``); the ranks agree the MAX of the first (the pace) and the MIN of the
    second (the floor) and send both back as op ``pace``. A daemon that pushes no floor
    (one from before floors, whose schema refuses the field) gets none, and adds none."""
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore(), probe_trial=False)
    try:
        with cbs[0].step(samples=1), cbs[1].step(samples=1):
            pass
        assert wait_for(lambda: len(daemon.registers) == 2, 20.0)
        for c, (pace, floor) in zip(daemon.server.connections(), ((0.30, 0.26), (0.20, None)), strict=True):
            c.send(
                {"v": 1, "job": "agree", "event": "local_pace", "step_s": pace, **({"floor_s": floor} if floor else {})}
            )
        assert wait_for(lambda: all(cb._channel.local_pace_s is not None for cb in cbs), 20.0)
        _step_ranks(cbs)
        assert wait_for(
            lambda: {"step_s": 0.30, "floor_s": 0.26} in daemon.paces and {"step_s": 0.30} in daemon.paces, 20.0
        )
        assert all(p in ({"step_s": 0.30, "floor_s": 0.26}, {"step_s": 0.30}) for p in daemon.paces), daemon.paces
    finally:
        for cb in cbs:
            cb.close()


def test_a_re_check_one_node_asks_reaches_every_rank_s_daemon_that_takes_it(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path
) -> None:  # type: ignore[no-untyped-def]
    """A node whose GPUs wait longer at the same step (it healed) asks every node to
    re-check its baseline from a job step (``recheck_at`` in ``local_pace``); the ranks
    agree the MAX with the pace and send it back in op ``pace``, to a daemon that pushes
    the field (one from before it refuses it, and gets none)."""
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore(), probe_trial=False)
    try:
        with cbs[0].step(samples=1), cbs[1].step(samples=1):
            pass
        assert wait_for(lambda: len(daemon.registers) == 2, 20.0)
        pushes = ({"step_s": 0.30, "recheck_at": 2106}, {"step_s": 0.20})  # (the second: a daemon from before)
        for c, push in zip(daemon.server.connections(), pushes, strict=True):
            c.send({"v": 1, "job": "agree", "event": "local_pace", **push})
        assert wait_for(lambda: all(cb._channel.local_pace_s is not None for cb in cbs), 20.0)
        _step_ranks(cbs)
        assert wait_for(
            lambda: {"step_s": 0.30, "recheck_at": 2106} in daemon.paces and {"step_s": 0.30} in daemon.paces, 20.0
        )
        assert all(p in ({"step_s": 0.30, "recheck_at": 2106}, {"step_s": 0.30}) for p in daemon.paces), daemon.paces
    finally:
        for cb in cbs:
            cb.close()


@pytest.mark.parametrize("trial", [True, False], ids=["trial", "probes"])
def test_ranks_whose_losses_differ_judge_the_blocks_together_and_roll_back_at_the_same_step(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, trial: bool
) -> None:  # type: ignore[no-untyped-def]
    """Each rank runs the probe blocks on its own losses, and they differ: here only rank
    1's show bf16 15 % worse (its share of the data), and rank 1 reads its losses at each
    step's end while rank 0 reads them every 16 steps. The ranks judge each block on all
    their verdicts pooled (greend.training._probe_ranks): every step runs at one level on
    both ranks, the blocks and the rollback included, for one reason, the job's (+7 to 8 %:
    the mean of 0 and 15 %). (Before, rank 1 rolled back alone and the ranks ran two levels
    until the next agreement on the level, and a late reader started the next block later.)"""

    torch.set_num_threads(1)
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore(), spike_tolerance=None, probe_trial=trial)
    cbs[0]._book.judge_within_s = 1e9  # (the count only: every 16 steps)
    cbs[1]._book.judge_within_s = 0.0  # (every step's end)
    rng = random.Random(7)
    noise = [[1.0 + rng.gauss(0, 0.02) for _ in range(300)] for _ in range(2)]

    def loss(r: int, i: int, ran: list[list[str]]) -> float:  # (inside step i: the level it runs at)
        return noise[r][i] * (1.15 if r == 1 and cbs[r]._book.precision == "bf16" else 1.0)

    ran = _lockstep(cbs, 300, {7: [(0, "bf16"), (1, "bf16")]}, loss)
    runs = [(level, len(list(g))) for level, g in itertools.groupby(ran[0])]
    assert [i for i in range(300) if ran[0][i] != ran[1][i]] == [], runs
    assert "bf16" in ran[0] and ran[0][-60:] == ["fp32"] * 60, runs
    # (turned down in its trial: "refused", the level never the job's; a rollback of a switch never made before)
    kind = "refused" if trial else "rollback"
    assert all(e["kind"] == kind for cb in cbs for e in cb.precision_events), [cb.precision_events for cb in cbs]
    back = [[e for e in cb.precision_events if e["kind"] == kind] for cb in cbs]
    assert len(back[0]) == len(back[1]) == 1 and back[0][0]["step"] == back[1][0]["step"], back
    assert back[0][0]["reason"] == back[1][0]["reason"] and "the mean loss of 2 ranks" in back[0][0]["reason"], back
    assert back[0][0]["reason"].count("barred for") == 1, back  # (the level's bar said once)


class _BreakingStore:
    """A dist.HashStore that fails every call once ``broken`` is set (a lost store master)."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.broken = False

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        call = getattr(self.inner, name)

        def checked(*args, **kw):  # type: ignore[no-untyped-def]
            if self.broken:
                raise RuntimeError("store master lost")
            return call(*args, **kw)

        return checked


@pytest.mark.parametrize("breaks_at", [150, 220, 290])
def test_a_store_lost_while_the_ranks_judge_a_block_leaves_each_rank_judging_alone(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, breaks_at: int
) -> None:  # type: ignore[no-untyped-def]
    """The job's store fails while a block waits for the ranks' losses (between its judging
    and decide_at, or before): each rank judges that block, and the ones after, on its own
    losses, logged once; none is left waiting for a verdict that never comes (rank 1's
    losses show a penalty from step 140 on: it still rolls back)."""

    torch.set_num_threads(1)
    store = _BreakingStore()
    cbs = _ranked_callbacks(monkeypatch, sock_path, store, spike_tolerance=None, probe_trial=False)
    rng = random.Random(3)
    noise = [[1.0 + rng.gauss(0, 0.02) for _ in range(600)] for _ in range(2)]

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        store.broken = i >= breaks_at
        worse = r == 1 and i >= 140 and cbs[r]._book.precision == "bf16"
        return noise[r][i] * (1.15 if worse else 1.0)

    ran = _lockstep(cbs, 600, {7: [(0, "bf16"), (1, "bf16")]}, loss)
    runs = [(level, len(list(g))) for level, g in itertools.groupby(ran[1])]
    assert "bf16" in ran[1] and ran[1][-100:] == ["fp32"] * 100, runs
    assert any(e["kind"] == "rollback" for e in cbs[1].precision_events)
    assert cbs[1]._control.prober is None or cbs[1]._control.prober.held is None


@pytest.mark.parametrize("nan_at", [600, 603, 611])
def test_after_one_rank_s_own_rollback_the_ranks_probe_at_the_same_steps_again(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, nan_at: int
) -> None:  # type: ignore[no-untyped-def]
    """fp32 -> bf16 -> fp8 on both ranks, then a non-finite loss on rank 0 alone at fp8: rank
    0 goes back to bf16 at once (the guard's own rule), rank 1 at the ranks' next agreement.
    Rank 0's probes (bf16 against fp32) then start at that agreement's step, where rank 1's
    do: before, rank 0 drew its blocks from its own rollback step and the ranks ran two
    levels at 75-80 steps of the next 1,000 (a reviewer's run)."""
    torch.set_num_threads(1)
    cbs = _three_levels(monkeypatch, sock_path, dist.HashStore())
    rng = random.Random(3)
    noise = [[1.0 + rng.gauss(0, 0.02) for _ in range(1600)] for _ in range(2)]

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        return float("nan") if (r == 0 and i == nan_at) else noise[r][i]

    ran = _lockstep(cbs, 1600, DOWN_TO_FP8, loss)
    assert ran[0][nan_at - 5 : nan_at] == ["fp8-emulated"] * 5, ran[0][nan_at - 5 : nan_at]
    apart = [i for i in range(nan_at, 1600) if ran[0][i] != ran[1][i]]
    assert apart and max(apart) < nan_at + 2 * 5 + 2, apart  # (until the agreement takes rank 1 up)
    assert ran[0][nan_at + 20 :].count("fp32") >= 10  # (the probes of bf16 against fp32 run again)
    assert cbs[0]._control.prober.anchor == cbs[1]._control.prober.anchor


class _FailsOnceAt:
    """A store as one rank sees it: its ``nth`` call of ``method`` on a key holding ``part``
    fails (or, ``armed``, the next one)."""

    def __init__(self, inner: object, method: str, part: str, nth: int = 0) -> None:
        self.inner, self.method, self.part, self.nth, self.count, self.armed = inner, method, part, nth, 0, False
        self.failed: list[int] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        call = getattr(self.inner, name)

        def checked(*args, **kw):  # type: ignore[no-untyped-def]
            key = args[0][0] if args and isinstance(args[0], list) else (args[0] if args else "")
            if name == self.method and self.part in str(key):
                self.count += 1
                if self.count == self.nth or self.armed:
                    self.armed = False
                    self.failed.append(self.count)
                    raise RuntimeError("store hiccup")
            return call(*args, **kw)

        return checked


def _apart(ran: list[list[str]]) -> list[int]:
    return [i for i in range(len(ran[0])) if ran[0][i] != ran[1][i]]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_failed_write_on_one_rank_leaves_the_ranks_judging_together(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, seed: int
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's first write of a block's losses fails: both ranks judge that block on rank
    0's losses (all the store has), at decide_at, and the next blocks together again. Before,
    that rank judged alone for the rest of the level, and the ranks ran two levels at 24 to
    188 steps of 1,500 (long blocks on one rank only; a reviewer's run)."""
    torch.set_num_threads(1)
    store = dist.HashStore()
    cbs = _ranked_callbacks(monkeypatch, sock_path, store, spike_tolerance=None, probe_trial=False, probe_every=60)
    cbs[1]._control.peers = JobPeers(_FailsOnceAt(store, "set", "/probe/", 1), "agree", 1)
    rng = random.Random(seed)
    noise = [[1.0 + rng.gauss(0, 0.03) for _ in range(1500)] for _ in range(2)]

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        return noise[r][i] * (1.035 if cbs[r]._book.precision == "bf16" else 1.0)

    ran = _lockstep(cbs, 1500, {7: [(0, "bf16"), (1, "bf16")]}, loss)
    assert cbs[1]._control.peers.store.failed  # (the hiccup happened)
    assert _apart(ran) == []


@pytest.mark.parametrize("every", [40, 60])
def test_ranks_that_read_apart_run_the_same_blocks_when_probe_every_is_small(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, every: int
) -> None:  # type: ignore[no-untyped-def]
    """A block placed when the ranks' verdict comes in starts at that step at the earliest,
    the same on every rank, not at a rank's own first step not yet started (which moves with
    how late it reads): with probe_every 40, 168 steps of 1,500 ran at two levels before."""
    torch.set_num_threads(1)
    cbs = _ranked_callbacks(monkeypatch, sock_path, dist.HashStore(), spike_tolerance=None, probe_trial=False,
                            probe_every=every)  # fmt: skip
    cbs[0]._book.judge_within_s = 1e9  # (every 16 steps)
    cbs[1]._book.judge_within_s = 0.0  # (every step's end)
    rng = random.Random(5)
    noise = [[1.0 + rng.gauss(0, 0.02) for _ in range(1500)] for _ in range(2)]
    ran = _lockstep(cbs, 1500, {7: [(0, "bf16"), (1, "bf16")]}, lambda r, i, ran: noise[r][i])
    assert _apart(ran) == []
    runs = [(level, len(list(g))) for level, g in itertools.groupby(ran[0])]
    blocks = [n for level, n in runs[1:-1] if level == "fp32"]
    assert blocks and min(blocks) >= 5, runs  # (no block cut short by its start having passed)


@pytest.mark.parametrize("nan_before", [1, 3, 9])
def test_a_rank_s_own_rollback_just_before_the_ranks_probes_roll_back_leaves_them_together(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, nan_before: int
) -> None:  # type: ignore[no-untyped-def]
    """fp8 15 % worse on both ranks: their probes roll fp8 back to bf16 together at step D.
    A non-finite loss on rank 0 alone a few steps before D takes it back first, on its own.
    Every rollback where the ranks agree starts the probes of the level it leads to at the
    agreement that has every rank there: the same step on both (before, rank 1 drew its
    blocks from D and rank 0 from the agreement: two levels at 70 steps)."""
    torch.set_num_threads(1)
    _, cbs = _fp8_worse(monkeypatch, sock_path, 1200, None)
    d = next(e["step"] for e in cbs[1].precision_events if e["kind"] == "rollback")
    ran, cbs = _fp8_worse(monkeypatch, sock_path, 1200, d - nan_before)
    assert [i for i in _apart(ran) if i > d - nan_before + 12] == []
    assert cbs[0]._control.prober.anchor == cbs[1]._control.prober.anchor


@pytest.mark.parametrize("lost_at", [601, 606])
def test_a_rank_s_probes_come_back_after_its_own_rollback_when_the_store_is_lost(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, lost_at: int
) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 rolls fp8 back to bf16 on its own (a non-finite loss) and its probes wait for
    the agreement that has both ranks at bf16; the store is lost before it comes: each rank
    alone from then on, rank 0's probes (bf16 against fp32) at once. Before, they never came
    back (899 steps at bf16 without a probe)."""
    torch.set_num_threads(1)
    store = _BreakingStore()
    cbs = _three_levels(monkeypatch, sock_path, store)

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        store.broken = i >= lost_at
        return float("nan") if (r == 0 and i == 600) else 1.0

    ran = _lockstep(cbs, 1000, DOWN_TO_FP8, loss)
    control = cbs[0]._control
    assert not control.agreeing and not control.rearm and control.prober.armed
    assert ran[0][620:].count("fp32") >= 10  # (probe blocks at fp32 again)


@pytest.mark.parametrize("nth", [3, 6, 9])
def test_one_failed_read_of_the_ranks_losses_on_one_rank_leaves_them_judging_together(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, nth: int
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 alone fares +10 % at bf16, rank 0 -2 % (the job's mean +4 %, within the 5 %
    tolerance): kept. Rank 1's read of the ranks' losses fails once, at its nth: it reads
    again at the next step (from READ_EARLY steps before the verdict on). Before, it judged
    that block on its own losses, and from then on its verdicts differed from rank 0's: two
    levels at 10-93 steps and rollbacks at different steps, on its own +8.9 % (a reviewer's runs)."""
    torch.set_num_threads(1)
    store = dist.HashStore()
    cbs = _ranked_callbacks(monkeypatch, sock_path, store, spike_tolerance=None, probe_trial=False, probe_every=60)
    flaky = _FailsOnceAt(store, "check", "/probe/", nth)
    cbs[1]._control.peers = JobPeers(flaky, "agree", 1)
    rng = random.Random(1)
    noise = [[1.0 + rng.gauss(0, 0.02) for _ in range(1500)] for _ in range(2)]
    worse = [-0.02, 0.10]

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        return noise[r][i] * (1 + worse[r] if cbs[r]._book.precision == "bf16" else 1.0)

    ran = _lockstep(cbs, 1500, {7: [(0, "bf16"), (1, "bf16")]}, loss)
    assert flaky.failed == [nth]
    assert _apart(ran) == []
    assert [e for cb in cbs for e in cb.precision_events if e["kind"] == "rollback"] == []


@pytest.mark.parametrize("after", [1, 3, 6])
def test_one_failed_level_agreement_after_the_ranks_probes_roll_back_leaves_them_together(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, after: int
) -> None:  # type: ignore[no-untyped-def]
    """fp8 15 % worse on both ranks: their probes roll fp8 back to bf16 together at step D;
    the probes of bf16 start again at a step counted from D, the same on both ranks. Rank
    1's read of the level agreement fails once, a few steps after D: it moves nothing (the
    step is not read from the agreement). Before, that rank started its probes an agreement
    later, or alone: two levels at 50-62 steps (a reviewer's runs)."""
    torch.set_num_threads(1)
    store = dist.HashStore()
    flaky = _FailsOnceAt(store, "check", "/precision/")
    cbs = _three_levels(monkeypatch, sock_path, store)
    cbs[1]._control.peers = JobPeers(flaky, "agree", 1)
    rng = random.Random(3)
    noise = [[1.0 + rng.gauss(0, 0.02) for _ in range(1400)] for _ in range(2)]
    seen: dict[str, int] = {}

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        back = [e["step"] for e in cbs[1].precision_events if e["kind"] == "rollback"]
        if back and "D" not in seen:
            seen["D"] = back[0]
        if r == 1 and i == seen.get("D", -1) + after:
            flaky.armed = True
        return noise[r][i] * (1.15 if cbs[r]._book.precision == "fp8-emulated" else 1.0)

    ran = _lockstep(cbs, 1400, DOWN_TO_FP8, loss)
    assert flaky.failed and "D" in seen
    assert _apart(ran) == []
    assert cbs[0]._control.prober.anchor == cbs[1]._control.prober.anchor
    assert ran[0][seen["D"] + 20 :].count("fp32") >= 10  # (the probes of bf16 run again)


@pytest.mark.parametrize(("first", "gap"), [(598, 3), (599, 1), (603, 4), (596, 6)])
def test_two_ranks_that_roll_back_on_their_own_either_side_of_an_agreement_probe_together_again(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, first: int, gap: int
) -> None:  # type: ignore[no-untyped-def]
    """A non-finite step that DDP spreads to both ranks, read at other steps: each rolls fp8
    back to bf16 on its own, either side of an agreement. Both start their probes at the
    first agreement that has both at bf16 (before, each at the agreement after its own word:
    two anchors, two levels at 60 steps of the next 470; a reviewer's runs)."""
    torch.set_num_threads(1)
    cbs = _three_levels(monkeypatch, sock_path, dist.HashStore())

    def loss(r: int, i: int, ran: list[list[str]]) -> float:
        return float("nan") if i == first + gap * r else 1.0

    ran = _lockstep(cbs, 1100, DOWN_TO_FP8, loss)
    assert [i for i in _apart(ran) if i > first + gap + 30] == []
    assert cbs[0]._control.prober.anchor == cbs[1]._control.prober.anchor


@pytest.mark.parametrize("before", [18, 30])
def test_a_rank_s_own_rollback_inside_the_ranks_last_block_leaves_them_probing_together(
    monkeypatch: pytest.MonkeyPatch, daemon, sock_path, before: int
) -> None:  # type: ignore[no-untyped-def]
    """fp8 15 % worse on both ranks; their probes roll back together at D. A non-finite loss
    on rank 0 inside the block judged at D, before its last step: rank 0 goes back alone and
    takes no part in that verdict. Both ranks start the probes of bf16 at the agreement that
    has both there (before: rank 1 at D, rank 0 an agreement later; anchors 445 and 460)."""
    torch.set_num_threads(1)
    _, cbs = _fp8_worse(monkeypatch, sock_path, 1400, None, sync_every=20)
    d = next(e["step"] for e in cbs[1].precision_events if e["kind"] == "rollback")
    ran, cbs = _fp8_worse(monkeypatch, sock_path, 1400, d - before, sync_every=20)
    assert [i for i in _apart(ran) if i > d + 45] == []
    assert cbs[0]._control.prober.anchor == cbs[1]._control.prober.anchor


def test_ranks_that_resolve_different_job_ids_are_told_so(monkeypatch: pytest.MonkeyPatch, sock_path) -> None:  # type: ignore[no-untyped-def]
    """A rank whose environment names another job than its peers' (SLURM_JOB_ID set on one
    rank only) was booked as a job of its own with no word: the job's halves in two reports.
    The ranks meet in the rendezvous store; one that differs gets a GreendWarning naming both
    ids and what to set. A second callback named otherwise (a second fit()) is no conflict."""
    import warnings

    from greend.errors import GreendWarning
    from greend.training import callback as cbmod
    from greend.training.callback import GreenCallback
    from greend.training.identity import job_elsewhere

    store = dist.HashStore()
    assert job_elsewhere("777", 0, 2, store) is None
    assert job_elsewhere("torchrun-127.0.0.1-29516", 1, 2, store) == "777"
    assert job_elsewhere("second", 0, 2, store) is None and job_elsewhere("second", 1, 2, store) is None
    assert job_elsewhere("x", 0, 1, store) is None and job_elsewhere("x", 0, 2, None) is None

    shared = dist.HashStore()
    monkeypatch.setattr(cbmod, "default_store", lambda: shared)
    monkeypatch.setenv("WORLD_SIZE", "2")
    got = []
    for rank, job in ((0, "777"), (1, "torchrun-127.0.0.1-29516")):
        monkeypatch.setenv("RANK", str(rank))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cb = GreenCallback(job=job, model=torch.nn.Linear(4, 2), socket=sock_path, initial_precision="fp32")
            cb.close()
        got.append(
            [str(x.message) for x in w if issubclass(x.category, GreendWarning) and "another rank" in str(x.message)]
        )
    assert got[0] == [] and len(got[1]) == 1, got
    assert "'torchrun-127.0.0.1-29516'" in got[1][0] and "'777'" in got[1][0] and "GREEND_JOB" in got[1][0]
