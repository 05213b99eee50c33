"""The ranks of one job agree on small figures (its pace) without a collective.

A collective on the job's own process group is the one thing an observer must
never issue: if some rank has no callback (greend on rank 0 only), or calls it at
another step, it collides with the job's own all-reduce (gloo aborts the process
with a "collective mismatch", NCCL hangs). So the ranks meet in the job's
rendezvous key-value store instead (``torch.distributed``'s default store: the
``TCPStore`` that torchrun, Slurm launchers and ``init_process_group`` all set up),
under keys of greend's own (``greend/<job>/...``), with calls that never wait:

* every ``sync_every`` steps (an *epoch*), each rank raises the epoch's key to its
  own figure if that is larger (compare-and-set, a few round trips at most; the pace's
  key holds the floor beside it, lowered the same way);
* it then reads the previous epoch's key, which every rank in step wrote one epoch
  ago: the MAX over the ranks that have a figure. A rank without a callback, or
  without a daemon, writes nothing and changes nothing; a rank that is behind only
  makes the figure one epoch older. Keys two epochs old are deleted.

Any failure (no process group, a store without compare-and-set, a lost master) is
the caller's to log once; training never sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from greend.protocol import MAX_STEP

__all__ = ["JobPeers", "default_store"]

_MAX_CAS_TRIES = 8


def default_store() -> Any | None:
    """The default process group's key-value store, or None where there is no process
    group. Raises RuntimeError where torch gives no way to it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise RuntimeError("this torch has no way to reach the process group's store")
    return get_store()


class JobPeers:
    """One job's meeting place in a key-value store with torch's ``Store`` API
    (``compare_set``, ``check``, ``get``, ``delete_key``)."""

    def __init__(self, store: Any, job: str, rank: int) -> None:
        self.store = store
        self.prefix = f"greend/{job}/"
        self.rank = rank

    @classmethod
    def of_process_group(cls, job: str, rank: int) -> JobPeers | None:
        """On the default process group's store (:func:`default_store`), or None where there is none."""
        store = default_store()
        return None if store is None else cls(store, job, rank)

    def _key(self, name: str, epoch: int) -> str:
        return f"{self.prefix}{name}/{epoch}"

    def _merge(self, key: str, mine: str, merge: Callable[[str], str]) -> None:
        """Compare-and-set ``key`` to ``mine`` where absent, else to ``merge(what is there)``
        until that is what is there (a few round trips at most)."""
        current = self.store.compare_set(key, "", mine)  # set if absent; else what is there
        for _ in range(_MAX_CAS_TRIES):
            text = current.decode() if isinstance(current, bytes) else str(current)
            merged = merge(text)
            if text == mine or merged == text:
                return
            current = self.store.compare_set(key, text, merged)

    def _read_text(self, name: str, epoch: int) -> str | None:
        """The epoch's key as text, or None if no rank wrote it (never waits)."""
        key = self._key(name, epoch)
        if epoch < 0 or not self.store.check([key]):
            return None
        raw = self.store.get(key)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def _drop_old(self, name: str, epoch: int) -> None:
        """Rank 0 deletes the key two epochs old: the store does not grow with the run."""
        if self.rank == 0 and epoch >= 2:
            self._delete(self._key(name, epoch - 2))

    def _delete(self, key: str) -> None:
        """Delete ``key``; a store without delete keeps its few bytes."""
        try:
            self.store.delete_key(key)
        except Exception:
            pass

    def raise_to(self, name: str, epoch: int, value: float) -> None:
        """Make the epoch's figure at least ``value`` (a MAX across ranks)."""
        mine = repr(float(value))
        self._merge(self._key(name, epoch), mine, lambda text: text if float(text) >= value else mine)

    def agree_pace(
        self, epoch: int, pace: float | None, floor: float | None, ask: int = 0
    ) -> tuple[float | None, float | None, int]:
        """Write this rank's figures for ``epoch`` and return those the ranks wrote for the
        epoch before: the job's pace (the slowest node's uncapped step time: the MAX),
        floor (the lowest uncapped step a node measured: the MIN; None where no rank had
        one) and the latest job step a node asked every node to re-check its baseline from
        (the MAX; 0: none). All in one key, ``"pace,floor[,ask]"`` (one compare-and-set loop
        and one read an epoch, as for one figure: each round trip to the store's master
        waits on the training thread). A rank without a pace writes nothing."""
        if pace is not None and pace > 0:
            low = floor if floor is not None and floor > 0 else None

            def merge(text: str) -> str:
                theirs = _unpair(text)
                return _pair(max(theirs[0], pace), _least(theirs[1], low), max(theirs[2], ask))

            self._merge(self._key("paces", epoch), _pair(pace, low, ask), merge)
        text = self._read_text("paces", epoch - 1)
        self._drop_old("paces", epoch)
        return (None, None, 0) if text is None else _unpair(text)

    def read(self, name: str, epoch: int) -> float | None:
        """The epoch's figure, or None if no rank wrote one (never waits)."""
        text = self._read_text(name, epoch)
        return None if text is None else float(text)

    def tell(self, name: str, text: str, forget: str | None = None) -> None:
        """Write this rank's ``text`` under ``name`` (one key a rank: :meth:`hear` reads them),
        and delete what it wrote under ``forget`` (read by every rank by now)."""
        self.store.set(f"{self.prefix}{name}/{self.rank}", text)
        if forget is not None:
            self._delete(f"{self.prefix}{forget}/{self.rank}")

    def hear(self, name: str, ranks: int) -> list[str]:
        """What the ranks 0 .. ``ranks`` - 1 wrote under ``name`` with :meth:`tell`: those that
        did (never waits)."""
        keys = [f"{self.prefix}{name}/{r}" for r in range(ranks)]
        if self.store.check(keys) and hasattr(self.store, "multi_get"):
            raws = self.store.multi_get(keys)  # (two round trips to the store's master in all)
        else:  # (some rank has not written: those that have, one by one)
            raws = [self.store.get(k) for k in keys if self.store.check([k])]
        return [raw.decode() if isinstance(raw, bytes) else str(raw) for raw in raws]

    def agree_max(self, name: str, epoch: int, value: float | None) -> float | None:
        """Write this rank's figure for ``epoch`` (None: nothing to add) and return the
        MAX the ranks wrote for the epoch before (None: none yet)."""
        if value is not None and value > 0:
            self.raise_to(name, epoch, value)
        agreed = self.read(name, epoch - 1)
        self._drop_old(name, epoch)
        return agreed


def _pair(pace: float, floor: float | None, ask: int = 0) -> str:
    # (no ask: the two fields a rank of an earlier release reads)
    return f"{pace!r}," + ("" if floor is None else repr(floor)) + (f",{ask}" if ask > 0 else "")


def _unpair(text: str) -> tuple[float, float | None, int]:
    pace, _, rest = text.partition(",")
    floor, _, ask = rest.partition(",")
    return float(pace), (float(floor) if floor else None), (min(max(int(ask), 0), MAX_STEP) if ask else 0)


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
