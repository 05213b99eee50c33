"""Per-job accounting: the energy ledger of every device, the registry of
training jobs and their ranks, and each job's report."""

from __future__ import annotations

from greend.jobs.ledger import Ledger
from greend.jobs.records import Job
from greend.jobs.registry import JobRegistry

__all__ = ["Job", "JobRegistry", "Ledger"]
