"""Per-job accounting: the energy ledger of every device, the registry of
training jobs and their ranks, and each job's report.

The socket's job ops are at the edge (:mod:`.ops`, the only module here that knows
connections and messages); the registry (:mod:`.registry`, on :mod:`.table`) keeps the
sessions, the jobs' lifecycle and the tick; :mod:`.booking` books the decoded rows
(pure); :mod:`.report` computes the figures; steps executed by a device model come in
through one callable (:mod:`.execution`)."""

from __future__ import annotations

from greend.jobs.ledger import Ledger
from greend.jobs.records import Job
from greend.jobs.registry import JobRegistry

__all__ = ["Job", "JobRegistry", "Ledger"]
