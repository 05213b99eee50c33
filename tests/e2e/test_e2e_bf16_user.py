"""The user who already trains in bf16: greend keeps the job's own level as the top of its
ladder, takes it down to FP8 (emulated on the CPU) and back, and never moves it above.

A real daemon on a simulated GPU, real CPU trainings (``tests/scripts/precision_trainer.py``):
a job that says ``initial_precision="bf16"``, one that runs its own ``torch.autocast`` and
says nothing, under the clock policies ``none`` and ``efficient`` and the ``precision``
policy beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_e2e_jobs import wait_ended
from tests.e2e.test_e2e_precision import run_trainer as precision_trainer
from tests.support import DaemonProc, start_daemon

pytestmark = [pytest.mark.e2e, pytest.mark.torch]
torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

BITS = {"fp32": 32, "tf32": 19, "bf16": 16, "fp16": 16, "fp8": 8, "fp8-emulated": 8}


def config(clock_policy: str, precision_policy: str) -> str:
    return f"""
[daemon]
socket_group = ""

[policy]
name = "{clock_policy}"
period_s = 0.2
settle_s = 0.0
precision = "{precision_policy}"

[policy.precision_params]
window = 16
min_steps = 8
max_slope = 0.1
max_noise = 0.2
probation_steps = 40
tolerance = 0.1
cooldown_s = 600.0
"""


def run_trainer(sock: Path, job: str, *args: str) -> dict[str, Any]:
    return precision_trainer(sock, job, *args, timeout=180)


def start(tmp_path: Path, daemons: list[DaemonProc], clock: str, precision: str) -> DaemonProc:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=config(clock, precision), name=f"{clock}-{precision}")
    daemons.append(d)
    return d


# A bf16 job with eligible linears for (emulated) fp8, on a compute-heavy workload.
BF16_JOB = ("--initial", "bf16", "--precisions", "bf16,fp8-emulated", "--fp8-min-features", "16")
BF16_JOB += ("--mem-share", "0.05", "--step-sleep", "0.01")


@pytest.mark.parametrize("clock, precision", [("none", "none"), ("efficient", "none"), ("none", "precision")])
def test_a_bf16_job_never_runs_above_bf16(
    tmp_path: Path, daemons: list[DaemonProc], clock: str, precision: str
) -> None:
    d = start(tmp_path, daemons, clock, precision)
    r = run_trainer(d.socket, "b", *BF16_JOB, "--steps", "300")
    rep = wait_ended(d, "b")
    levels = r["levels"]
    assert levels[0] == "bf16" and max(BITS[v] for v in levels) == 16, levels[::20]
    refused = [e for e in r["precision_events"] if e["kind"] == "refused"]
    assert refused == [], refused  # nothing asked it above its level
    log = rep.get("precision_log") or []
    assert all(BITS[e["to"]] <= 16 for e in log if e.get("to")), log
    if precision == "none":
        assert set(levels) == {"bf16"} and log == []  # policy none changes no job's precision
        assert rep["precision"] == "bf16"
    _saving_is_a_share_of_the_jobs_gpu_energy(rep)


def _saving_is_a_share_of_the_jobs_gpu_energy(rep: dict[str, Any]) -> None:
    """Every saved % is of the job's whole GPU energy (its steps and the idle GPU between
    them), so a job whose steps are a small part of it saves at most that part (sim)."""
    sv = rep["savings"]
    if sv["saved_j"] is None:
        return
    gpu_e, saved, steps_e = rep["gpu_energy_j"], sv["saved_j"], rep["sim_energy_j"]
    assert sv["gpu_energy_j"] == pytest.approx(gpu_e)
    assert sv["expected_gpu_energy_j"] == pytest.approx(gpu_e + saved)
    assert sv["saved_pct"] == pytest.approx(100 * saved / (gpu_e + saved))
    steps_share = (steps_e + max(saved, 0.0)) / (gpu_e + max(saved, 0.0))
    assert abs(sv["saved_pct"]) <= 100 * steps_share + 1e-9, (sv, steps_share)
    assert steps_share < 0.5  # these CPU jobs' simulated steps are a small part of the GPU's time
    assert sv["confidence"]["saved_j_95"] is None and sv["confidence"]["level"] == "sim"  # no zero-width interval


def test_a_bf16_job_steps_down_to_fp8_and_back_up_on_a_penalty(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start(tmp_path, daemons, "none", "precision")
    # A spike 3 steps after the first fp8 step (the step down's trial): the guard goes back to
    # bf16, the job's own level; the job never ran fp8 but for the trial's blocks, so the
    # daemon hears fp8 refused (no switch logged).
    r = run_trainer(d.socket, "fp8", *BF16_JOB, "--steps", "300", "--inject-spike-after-switch", "3")
    rep = wait_ended(d, "fp8")
    levels, bad = r["levels"], r["poisoned"]
    assert bad is not None, f"never switched below bf16: {levels[::20]}"
    assert levels[bad] == "fp8-emulated" and levels[bad + 1] == "bf16", levels[bad - 2 : bad + 3]
    assert set(levels[bad + 1 :]) == {"bf16"}  # back at its own level, fp8 barred for the cooldown
    (ev,) = r["precision_events"]
    assert (ev["kind"], ev["from"], ev["to"]) == ("refused", "bf16", "fp8-emulated"), ev
    log = [(e["kind"], e["from"], e["to"]) for e in rep["precision_log"]]
    assert ("refused", "bf16", "fp8-emulated") in log and ("switch", "bf16", "fp8-emulated") not in log, log
    report = d.ctl("report", "fp8").stdout
    assert "fp8-emulated" in report and "refused" in report
    _saving_is_a_share_of_the_jobs_gpu_energy(rep)


def test_a_job_running_its_own_autocast_is_seen_as_bf16(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start(tmp_path, daemons, "efficient", "precision")
    r = run_trainer(d.socket, "own", "--own-autocast", "--steps", "120", "--step-sleep", "0.01", "--mem-share", "0.05")
    rep = wait_ended(d, "own")
    assert set(r["levels"]) == {"bf16"}, r["levels"][::10]  # detected at its first step, never moved up
    assert r["precision_events"] == []
    assert rep["precision"] == "bf16"
    assert all(BITS[e["to"]] <= 16 for e in rep.get("precision_log") or [] if e.get("to"))


def _no_upward_word(caught: list[Any]) -> None:
    words = [str(w.message) for w in caught if "asked for precision" in str(w.message)]
    assert words == [], words  # greend never asked the job to leave its own level


def test_lightning_bf16_mixed_stays_bf16_with_a_daemon(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    import importlib.util
    import warnings

    pl = (
        pytest.importorskip("pytorch_lightning")
        if importlib.util.find_spec("lightning") is None
        else pytest.importorskip("lightning.pytorch")
    )
    from greend.integrations.lightning import GreenLightningCallback
    from tests.training.test_callback import BATCH, FAST, make_data, make_model

    d = start(tmp_path, daemons, "efficient", "precision")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.dtypes: list[torch.dtype] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            h = self.net[0](x)
            self.dtypes.append(h.dtype)
            return torch.nn.functional.mse_loss(self.net[2](self.net[1](h)).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = make_data(12)
    loader = torch.utils.data.DataLoader([(x[i], y[i]) for x, y in data for i in range(BATCH)], batch_size=BATCH)
    module = Module()
    cb = GreenLightningCallback(job="pl-bf16", socket=d.socket, gpus=[0], **FAST)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    _no_upward_word(caught)
    assert module.dtypes == [torch.bfloat16] * 12 and cb.precision == "bf16"
    rep = wait_ended(d, "pl-bf16")
    assert rep["precision"] == "bf16" and not [e for e in rep.get("precision_log") or [] if e["kind"] == "refused"]


def test_hugging_face_bf16_stays_bf16_with_a_daemon(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    import warnings

    transformers = pytest.importorskip("transformers")
    from greend.integrations.hf import GreenHFCallback
    from tests.training.test_callback import BATCH, FAST, make_data
    from tests.training.test_integrations import HFTiny

    d = start(tmp_path, daemons, "efficient", "precision")
    rows = [{"x": x[i], "labels": y[i]} for x, y in make_data(10) for i in range(BATCH)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=10,
        per_device_train_batch_size=BATCH,
        report_to=[],
        use_cpu=True,
        bf16=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=0.05,
        optim="sgd",
        max_grad_norm=0.0,
    )
    cb = GreenHFCallback(job="hf-bf16", socket=d.socket, gpus=[0], **FAST)
    trainer = transformers.Trainer(model=HFTiny(), args=args, train_dataset=rows, callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    _no_upward_word(caught)
    assert cb.precision == "bf16"
    rep = wait_ended(d, "hf-bf16")
    assert rep["precision"] == "bf16" and not [e for e in rep.get("precision_log") or [] if e["kind"] == "refused"]
