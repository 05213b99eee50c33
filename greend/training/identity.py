"""Who a training process is, as it tells the daemon when it registers.

* **Job id**: ``job=``, else ``$GREEND_JOB``, else Slurm's ``$SLURM_JOB_ID`` (with
  ``.$SLURM_STEP_ID`` under srun: ``1234.0``, as sacct names the step), else
  torchrun's ``$TORCHELASTIC_RUN_ID`` when it is a real id (torchrun without
  ``--rdzv-id`` sets it to ``none``: then ``torchrun-<MASTER_ADDR>-<MASTER_PORT>``,
  the rendezvous every rank of that run shares and no other running job can), else,
  for a rank of several started without torchrun but told the rendezvous (a Kubeflow
  PyTorchJob's pods: ``$MASTER_ADDR``, ``$MASTER_PORT``, ``$WORLD_SIZE`` > 1),
  ``dist-<MASTER_ADDR>-<MASTER_PORT>``, else ``<host>-<pid>-<unix time>``
  (:func:`resolve_job`).
* **Run id**: what tells one run of a job id from another (a rerun, an id reused):
  ``$GREEND_RUN`` if the launcher sets it, else, with a process group, the first
  rank's random id agreed through the job's rendezvous store (every rank of the run
  reads the same key; a restart gets a new store and a new run), else, for a rank of
  several without a process group, a digest of what the launcher gave every rank
  alike (the job, the rendezvous address and port, Slurm's restart count), else a random
  id (:func:`resolve_run`). Some launchers give every run alike (a static torchrun
  rerun, a PyTorchJob run again, an elastic restart): the daemon tells them apart by the
  steps a registering process sent before (none: a new process, a new record), never
  resuming a run's record for another run.
* **Ranks**: rank and world size from ``torch.distributed`` if initialised, else
  ``$RANK``/``$WORLD_SIZE``; ``$LOCAL_RANK`` for the local rank
  (:func:`resolve_ranks`).
* **GPUs**: ``gpus=`` if given, else the model's CUDA device (``cuda:N`` mapped
  through ``$CUDA_VISIBLE_DEVICES`` to the node-local index, the daemon's; a GPU
  UUID ``GPU-...`` or a MIG instance's ``MIG-...`` there is looked up by UUID through
  NVML in this process, a MIG instance as its parent GPU; one that cannot be mapped
  reports no GPUs, with a warning that says why, never a guessed index). A model on the CPU
  with ``gpus=None`` reports no GPUs (``[]``): pass ``gpus=[...]`` to attribute a
  CPU run to (simulated) GPUs, as ``greenctl demo`` does with ``gpus=[0]``
  (:func:`resolve_gpus`).
* **Socket**: ``socket=``, else ``$GREEND_SOCKET``, else
  ``/run/greend/greend.sock`` (:func:`resolve_socket`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from greend.protocol import DEFAULT_SOCKET, JOB_ID_RE, RUN_ID_RE

__all__ = [
    "DEFAULT_SOCKET",
    "job_elsewhere",
    "model_device",
    "nvml_index_of_uuid",
    "resolve_gpus",
    "resolve_job",
    "resolve_ranks",
    "resolve_run",
    "resolve_socket",
    "socket_hostname",
]

# The callback's log lines, wherever in greend.training they are made, go to one logger.
log = logging.getLogger("greend.training.callback")


def _job_from_env() -> str | None:
    """The job id the launcher gives every rank alike, or None."""
    value = os.environ.get("GREEND_JOB", "").strip()
    if value:
        return value
    slurm = os.environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        # Slurm's own name for a step, JOBID.STEP (as sacct shows it): two sruns of one
        # allocation are two runs, not one job resumed.
        step = os.environ.get("SLURM_STEP_ID", "").strip()
        return f"{slurm}.{step}" if step.isdigit() else slurm
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id.lower() != "none":
        return run_id
    addr, port = os.environ.get("MASTER_ADDR", "").strip(), os.environ.get("MASTER_PORT", "").strip()
    if run_id and addr and port:  # torchrun without --rdzv-id: its rendezvous endpoint tells runs apart
        return f"torchrun-{addr}-{port}"
    if addr and port and _env_int("WORLD_SIZE", 1) > 1:
        # Ranks started without torchrun, each told the rendezvous (a Kubeflow PyTorchJob's
        # pods, mpirun, a hand-written launcher): its endpoint is the job's, on every rank.
        return f"dist-{addr}-{port}"
    return None


def _sanitize_job(name: str) -> str:
    """``name`` made into a valid job id: other characters become '-', at most 128."""
    cleaned = re.sub(r"[^A-Za-z0-9._:@/-]", "-", name)[:128]
    return cleaned or "job"


def resolve_job(job: str | None) -> str:
    """The job id: ``job``, else the environment, else ``<host>-<pid>-<time>``."""
    if job is not None:
        if not isinstance(job, str) or not JOB_ID_RE.match(job):
            raise ValueError(f"job={job!r}: a job id is 1-128 characters of letters, digits and ._:@/-")
        return job
    value = _job_from_env()
    if value:
        job = _sanitize_job(value)
        if job != value:  # (say it: `greenctl report` wants the id as booked)
            log.warning("the job id from the environment, %r, is booked as %r (a job id is 1-128 characters of "
                        "letters, digits and ._:@/-)", value, job)  # fmt: skip
        return job
    return _sanitize_job(f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}")


# (Not torchrun's TORCHELASTIC_RESTART_COUNT: the agent of a node whose workers restarted
# only because another node's failed does not count up, so one attempt had a run id per
# node. Its attempts share an id: the daemon tells their records apart, and each node's
# latest is the latest attempt's.)
_RUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID",
            "SLURM_RESTART_COUNT")  # fmt: skip


def resolve_run(job: str, world_size: int, store: Any | None = None) -> str:
    """This run's id, the same on every rank of the run (see the module's docstring).
    ``store``: the job's rendezvous key-value store (torch's ``Store`` API), if any."""
    given = os.environ.get("GREEND_RUN", "").strip()
    if given:
        run = re.sub(r"[^A-Za-z0-9._-]", "-", given)[:64]  # as a job id from the environment
        if run != given:
            log.warning("GREEND_RUN=%r is booked as run %r (a run id is 1-64 characters of letters, digits "
                        "and ._-)", given, run)  # fmt: skip
        return run
    mine = uuid.uuid4().hex[:12]
    if store is not None:
        try:
            # The first rank to get here sets it; every other reads it back (no waiting).
            # The n-th run of the job in this process group (a second fit() or train()): a
            # key of its own, n counted from the callbacks every rank made for the job.
            n = (int(store.add(f"greend/{job}/runs", 1)) - 1) // max(1, world_size) + 1
            agreed = store.compare_set(f"greend/{job}/run" + (f"/{n}" if n > 1 else ""), "", mine)
            text = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
            if RUN_ID_RE.match(text):
                return text
        except Exception as e:
            log.debug("no run id through the rendezvous store: %s", e)
    if world_size > 1:
        shared = [os.environ.get(k, "") for k in _RUN_ENV]
        if any(shared):
            return hashlib.sha256("\0".join([job, *shared]).encode()).hexdigest()[:12]
    return mine


def job_elsewhere(job: str, rank: int, world_size: int, store: Any | None = None) -> str | None:
    """The job id another rank of this process group resolved, where it differs from
    ``job`` (their environments differ: ``SLURM_JOB_ID`` set on some ranks only, a
    ``GREEND_JOB`` on one), else None. The first rank to get here sets it in the job's
    rendezvous store (the n-th callback of each rank meets the others' n-th: a second
    fit() named otherwise is no conflict); None without a store or on any failure."""
    if store is None or world_size < 2:
        return None
    try:
        n = (int(store.add("greend/job-ids", 1)) - 1) // world_size + 1
        first = store.compare_set(f"greend/job-id/{n}", "", job)
        text = first.decode() if isinstance(first, bytes) else str(first)
    except Exception as e:
        log.debug("rank %d: no job id check through the rendezvous store: %s", rank, e)
        return None
    return text if text and text != job else None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def resolve_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torch.distributed, else the launcher's env:
    torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, else srun's ``SLURM_PROCID``/
    ``SLURM_LOCALID``/``SLURM_STEP_NUM_TASKS`` (the tasks of one ``srun`` step are the ranks
    of one job, before or without a process group; a batch script's own process, which
    srun did not start, has no ``SLURM_STEP_NUM_TASKS`` and is one process)."""
    slurm = "RANK" not in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ and "SLURM_PROCID" in os.environ
    rank = _env_int("SLURM_PROCID" if slurm else "RANK", 0)
    world = _env_int("SLURM_STEP_NUM_TASKS" if slurm else "WORLD_SIZE", 1)
    local = _env_int("SLURM_LOCALID" if slurm else "LOCAL_RANK", 0)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return max(rank, 0), max(local, 0), max(world, 1)


def model_device(model: torch.nn.Module | None, device: str | torch.device | None) -> torch.device:
    """``device`` if given, else the device of the model's first parameter or buffer, else
    cuda where torch sees a CUDA GPU (a job on a GPU node trains there: step.autocast()
    must cast on it, not on the CPU), else cpu."""
    if device is not None:
        return torch.device(device)
    if model is not None:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            return tensor.device
    try:
        if torch.cuda.is_available():
            return torch.device("cuda")
    except Exception:
        pass
    return torch.device("cpu")


def nvml_index_of_uuid(uuid: str, nvml: Any | None = None) -> int:
    """The node-local (NVML) index of the GPU with ``uuid``; for a MIG instance's
    UUID, its parent GPU's. ``nvml``: the module (default ``import pynvml``).
    Raises LookupError saying why when it cannot be found."""
    if nvml is None:
        try:
            import pynvml
        except ImportError as e:
            raise LookupError("the nvidia-ml-py package (pynvml) is not installed in this process") from e
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as e:
        raise LookupError(f"NVML could not be initialised here: {e}") from e
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        if uuid.startswith("MIG-"):
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        return int(nvml.nvmlDeviceGetIndex(handle))
    except Exception as e:
        raise LookupError(f"NVML does not know {uuid}: {e}") from e
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def resolve_gpus(
    dev: torch.device,
    gpus: Iterable[int] | None,
    uuid_to_index: Callable[[str], int] | None = None,
) -> list[int]:
    """Node-local GPU indices: ``gpus`` if given, else the CUDA device mapped through
    CUDA_VISIBLE_DEVICES (``uuid_to_index``, default :func:`nvml_index_of_uuid`, maps
    a ``GPU-``/``MIG-`` entry; LookupError: unmappable, and no GPUs are reported)."""
    if gpus is not None:
        out = [int(g) for g in gpus]
        if any(g < 0 for g in out):
            raise ValueError(f"gpus={out!r}: GPU indices are >= 0")
        return out
    if dev.type != "cuda":
        return []
    index = dev.index
    if index is None:
        try:
            # (current_device() would set CUDA up in a process that has not yet: the local rank)
            index = torch.cuda.current_device() if torch.cuda.is_initialized() else _local_rank()
        except Exception:
            index = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return [index]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if dev.index is None and len(entries) == 1:
        index = 0  # (a task given one GPU of its own: srun --gpus-per-task=1; it is cuda:0)
    if index >= len(entries):
        why = f"CUDA_VISIBLE_DEVICES lists {len(entries)} device(s)"
    elif entries[index].isdigit():
        return [int(entries[index])]
    else:
        entry = entries[index]
        try:
            found = (uuid_to_index or nvml_index_of_uuid)(entry)
        except LookupError as e:
            why = str(e)
        else:
            if entry.startswith("MIG-"):
                log.info(
                    "cuda:%d is MIG instance %s of gpu%d: its energy is the whole GPU's, shared by "
                    "every job on that GPU",
                    index,
                    entry,
                    found,
                )
            return [int(found)]
    log.warning(
        "cannot map cuda:%d through CUDA_VISIBLE_DEVICES=%s to a node-local GPU index (%s); "
        "reporting no GPUs, so none of the node's energy is attributed to this job: pass gpus=[...]",
        index,
        visible,
        why,
    )
    return []


def resolve_socket(socket_path: str | os.PathLike[str] | None) -> Path:
    """The daemon's socket: ``socket_path``, else ``$GREEND_SOCKET``, else :data:`DEFAULT_SOCKET`."""
    path = socket_path if socket_path is not None else os.environ.get("GREEND_SOCKET") or DEFAULT_SOCKET
    return Path(path)


def socket_hostname() -> str:
    """This node's hostname (informational, in the registration)."""
    try:
        return socket.gethostname()
    except OSError:
        return "localhost"


def _local_rank() -> int:
    """The node-local rank a launcher set (torchrun's LOCAL_RANK, srun's SLURM_LOCALID), else 0:
    the GPU a rank of a job that sets no device explicitly is usually given."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        v = os.environ.get(var, "")
        if v.isdigit():
            return int(v)
    return 0
