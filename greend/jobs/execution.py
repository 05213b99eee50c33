"""Steps executed by a device model: what the jobs domain asks of one, and its answer.

On GPUs that a model of the device stands for (``greend run --sim``), every row of steps
a rank reports is executed there at the GPU's settings in force: the row's time and
energy come from the model, for its FLOPs and the workload's memory-bound share, while
the training itself runs for real on the CPU. The jobs domain knows such a model only as
a :class:`StepExecutor`, one callable the daemon builds from its probes and hands to the
:class:`~greend.jobs.registry.JobRegistry`; on real GPUs it answers None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from greend.protocol import StepsRow

__all__ = ["ExecutedRow", "StepExecutor", "no_model"]


@dataclass(frozen=True, slots=True)
class ExecutedRow:
    """One row of steps as the model ran it: its time and its energy."""

    duration_s: float  # the row's steps one after another, on the slowest of the rank's GPUs
    energy_j: float  # on all of the rank's GPUs together


class StepExecutor(Protocol):
    """Executes a rank's rows of steps on the device models behind its GPUs.

    ``gpus``: the rank's GPUs (a row's FLOPs are split evenly over those a model stands
    for); ``mem_share``: the rank's memory-bound share of a step (None: each device's
    own); ``precision``: the level of a row that names none (the job's); ``pid``: the
    rank's process, which the devices list as computing on them. Returns each row's
    :class:`ExecutedRow`, in order, or None where no GPU of ``gpus`` is modelled."""

    def __call__(
        self, gpus: Sequence[int], rows: Sequence[StepsRow], *, mem_share: float | None, precision: str, pid: int
    ) -> list[ExecutedRow] | None: ...


def no_model(
    gpus: Sequence[int], rows: Sequence[StepsRow], *, mem_share: float | None, precision: str, pid: int
) -> list[ExecutedRow] | None:
    """The executor of a node without device models: real GPUs run the steps."""
    return None
