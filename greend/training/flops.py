"""FLOP counting for the training side.

greend prices energy per FLOP, so the training process reports how many
floating-point operations each step performed. There are three ways to get
the number, cheapest last:

1. **Count** one real step with :class:`torch.utils.flop_counter.FlopCounterMode`
   (forward *and* backward matmuls, convolutions and attention; not the optimizer
   or elementwise ops). Counting costs 10-370% of a step, so the callback counts
   once per input shape and caches the result (:class:`FlopCounter`).
2. **Estimate** a transformer as ``6 * params * tokens`` (:func:`transformer_flops`,
   the usual forward+backward rule; attention's own ``S^2`` term is left out).
3. **Be told**: the user passes ``flops_per_step=``.

On the CPU, ``torch.nn.functional.scaled_dot_product_attention`` runs as
``aten._scaled_dot_product_flash_attention_for_cpu``, which torch's counter
does not know (it counts 0 FLOPs for it). Importing this module registers a
formula for that op and its backward, the same formulas torch uses for the CUDA
flash/efficient kernels: forward ``4*B*H*S_q*S_k*D`` (two batched matmuls),
backward 2.5x that (five). :func:`register_cpu_attention_formulas` is
idempotent and does nothing if a future torch ships its own formula.

Example::

    from greend.training.flops import count_flops
    n = count_flops(lambda: model(x).sum().backward())
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils import flop_counter as _fc
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "FlopEstimates",
    "FlopCounter",
    "batch_rows",
    "batch_signature",
    "count_flops",
    "estimate_from_sizes",
    "estimate_new_shape",
    "model_params",
    "register_cpu_attention_formulas",
    "signature_elements",
    "stop_leaked",
    "transformer_flops",
]

log = logging.getLogger(__name__)
_Tensor = torch.Tensor

_aten = torch.ops.aten


def _cpu_sdpa_forward(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """FLOPs of ``_scaled_dot_product_flash_attention_for_cpu`` (q@k^T and p@v)."""
    try:
        return int(_fc.sdpa_flop_count(query_shape, key_shape, value_shape))
    except Exception:
        log.debug("cannot count CPU attention for shapes %s %s %s", query_shape, key_shape, value_shape)
        return 0


def _cpu_sdpa_backward(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """FLOPs of ``_scaled_dot_product_flash_attention_for_cpu_backward`` (5 matmuls)."""
    try:
        return int(_fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))
    except Exception:
        log.debug("cannot count CPU attention backward for shapes %s %s", grad_out_shape, query_shape)
        return 0


def register_cpu_attention_formulas() -> list[str]:
    """Teach FlopCounterMode the CPU flash-attention ops; return the names newly registered.

    Safe to call many times: an op already in torch's registry (registered by us
    earlier, or by a newer torch) is left alone.
    """
    added: list[str] = []
    pairs: list[tuple[str, Callable[..., int]]] = [
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward),
    ]
    for name, formula in pairs:
        op = getattr(_aten, name, None)
        if op is None:  # an older or newer torch without this op
            continue
        if op in _fc.flop_registry:
            continue
        try:
            _fc.register_flop_formula(op)(formula)
        except (RuntimeError, ValueError) as e:  # duplicate or an unexpected op type
            log.debug("not registering a FLOP formula for %s: %s", name, e)
            continue
        added.append(name)
    return added


register_cpu_attention_formulas()


# The counters counting now, each with the thread that started it: a step that raised
# where no hook saw it end (a Hugging Face Trainer's train() gives its callbacks none) left
# its FlopCounterMode on, and every torch op after it ran 2-3x slower (stop_leaked()).
_LIVE: weakref.WeakKeyDictionary[FlopCounter, int] = weakref.WeakKeyDictionary()


def stop_leaked() -> int:
    """Stop the counts this thread left running (steps that raised and never ended): called
    where no step of this thread can be running, as a new callback is made. How many."""
    me = threading.get_ident()
    leaked = [c for c, t in list(_LIVE.items()) if t == me and c.active]
    for c in reversed(leaked):  # (the latest first: modes leave their stack in order)
        c.stop()
    if leaked:
        log.warning("greend: stopped %d FLOP count(s) left running by a step that raised (a failed "
                    "Trainer.train()?): they slowed every torch operation since", len(leaked))  # fmt: skip
    return len(leaked)


class FlopCounter:
    """Count the FLOPs of whatever torch runs between :meth:`start` and :meth:`stop`.

    A thin wrapper over FlopCounterMode that never prints and never raises:
    if counting cannot start, :meth:`stop` returns ``None``.
    """

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> bool:
        if self._mode is not None:
            return True
        try:
            mode = FlopCounterMode(display=False)
            mode.__enter__()
        except Exception as e:
            log.warning("cannot count FLOPs (FlopCounterMode failed to start: %s)", e)
            return False
        self._mode = mode
        _LIVE[self] = threading.get_ident()
        return True

    def stop(self) -> int | None:
        mode, self._mode = self._mode, None
        _LIVE.pop(self, None)
        if mode is None:
            return None
        try:
            mode.__exit__(None, None, None)
            return int(mode.get_total_flops())
        except Exception as e:
            log.warning("cannot count FLOPs (FlopCounterMode failed: %s)", e)
            return None


def count_flops(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` once under FlopCounterMode and return the FLOPs it performed."""
    with FlopCounterMode(display=False) as mode:
        fn()
    return int(mode.get_total_flops())


def model_params(model: torch.nn.Module, *, trainable_only: bool = True) -> int:
    """Number of parameters of ``model`` (each shared Parameter once)."""
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def transformer_flops(params: int, tokens: int) -> float:
    """The ``6 * N * T`` rule: forward (2 N T) plus backward (4 N T) FLOPs for T tokens."""
    return 6.0 * float(params) * float(tokens)


MAX_DEPTH = 4  # levels of nested tuples, lists and mappings a batch's signature looks into


def _leaf_signature(x: Any, depth: int = 1) -> Hashable:
    if type(x) is _Tensor or isinstance(x, torch.Tensor):  # (the exact type first: a step's hot path)
        return (x.shape, x.dtype)  # torch.Size: a tuple, equal and hashed as one
    if isinstance(x, (int, float, str, bool)) or x is None:
        return type(x).__name__  # values do not change a step's FLOPs
    shape = getattr(x, "shape", None)  # numpy arrays and friends
    if shape is not None:
        try:
            return (tuple(shape), str(getattr(x, "dtype", "")))
        except TypeError:
            pass
    if depth < MAX_DEPTH and (_tensors(x) or (hasattr(x, "keys") and hasattr(x, "__getitem__"))):
        # A nested batch ({"enc": {"ids": ...}}, a list of images): its shapes, not only its
        # type's name (a padded length inside it changes the FLOPs). Not a list of other
        # things (per-sample targets, metadata): their sizes change no FLOPs, and walking
        # them costs each step microseconds.
        return (type(x).__name__, batch_signature(x, _depth=depth + 1))
    return type(x).__name__


def _tensors(x: Any) -> bool:
    """Whether ``x`` is a tuple or list of tensors (or arrays), by its first few items."""
    return isinstance(x, (tuple, list)) and bool(x) and all(getattr(v, "shape", None) is not None for v in x[:4])


def batch_signature(batch: Any, *, max_items: int = 16, _depth: int = 1) -> Hashable:
    """A cheap, hashable signature of a batch's tensor shapes and dtypes.

    Looks into tuples, lists and mappings, nested up to :data:`MAX_DEPTH` levels (at
    most ``max_items`` entries each; HF ``BatchEncoding`` is a mapping), so it costs
    about a microsecond per tensor. Two batches with the same signature are assumed
    to cost the same FLOPs; pass ``shape_key=`` to :meth:`GreenCallback.step` when
    that is not true (e.g. a length given as a number, not as a tensor's shape).
    """
    if isinstance(batch, torch.Tensor):
        return (batch.shape, batch.dtype)  # torch.Size: a tuple, equal and hashed as one
    if isinstance(batch, (tuple, list)):  # (a step's hot path: a list, no generator)
        items = batch if len(batch) <= max_items else batch[:max_items]
        return tuple([_leaf_signature(x, _depth) for x in items])
    keys = getattr(batch, "keys", None)
    if keys is not None and hasattr(batch, "__getitem__"):
        try:
            return tuple([(k, _leaf_signature(batch[k], _depth)) for k in list(keys())[:max_items]])
        except Exception:
            return type(batch).__name__
    return _leaf_signature(batch, _depth)


def batch_rows(batch: Any, _depth: int = 0) -> int | None:
    """The samples in a batch: a tensor's (or an array's) first dimension; in a tuple, a
    list or a mapping, its first part's rows, where a list or tuple inside it counts its
    items (``([16 images], [16 targets])``: 16); a ``PackedSequence``, its sequences. None
    where there are no rows to count. A batch that is not batch-first (time-major) needs
    ``samples=``."""
    sizes = getattr(batch, "batch_sizes", None)  # a PackedSequence (a tuple of tensors)
    if sizes is not None and getattr(batch, "data", None) is not None:
        try:
            return int(sizes[0]) if len(sizes) else None
        except Exception:
            return None
    shape = getattr(batch, "shape", None)  # a tensor, a numpy array and friends
    if shape is None:
        if _depth >= MAX_DEPTH:
            return None
        if isinstance(batch, (tuple, list)):
            if _depth > 0:
                return len(batch)  # (inside a batch: one item a sample)
            return batch_rows(batch[0], _depth + 1) if batch else None
        keys = getattr(batch, "keys", None)
        if keys is None or not hasattr(batch, "__getitem__"):
            return None
        try:
            first = next(iter(keys()), None)
            return None if first is None else batch_rows(batch[first], _depth + 1)
        except Exception:
            return None
    try:
        rows = shape[0] if len(shape) else None
    except TypeError:
        return None
    return rows if type(rows) is int and rows >= 0 else None


def signature_elements(signature: Any) -> int | None:
    """The number of elements a shape key stands for: a shape's product, summed over the
    tensors of a :func:`batch_signature` (dtypes, names and type names add nothing), or
    None where the key holds no shape (a user's ``shape_key="long"``, a negative number)."""
    if isinstance(signature, tuple):
        if signature and all(type(d) is int and d >= 0 for d in signature):  # a shape (torch.Size too)
            return math.prod(signature)
        parts = [signature_elements(part) for part in signature]
        known = [n for n in parts if n is not None]
        return sum(known) if known else None
    if type(signature) is int and signature >= 0:  # a user's key that is a size: a sequence-length bucket
        return signature
    return None


# A line (or, with enough shapes, a parabola that bends up, as attention's square term
# does) through the counted shapes is used for a new one within their range of sizes only
# where it gives every counted shape's FLOPs within this share.
FIT_WITHIN = 0.05
QUADRATIC_FROM = 5  # distinct counted sizes before the square term is fitted


def _polyfit(points: list[tuple[float, float]], degree: int) -> list[float] | None:
    """Least-squares polynomial coefficients (lowest first) of ``points`` by the normal
    equations (a 2x2 or 3x3 system: Gaussian elimination), or None where it is singular."""
    k = degree + 1
    a = [[sum(x ** (i + j) for x, _ in points) for j in range(k)] for i in range(k)]
    b = [sum(y * x**i for x, y in points) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, abs(a[0][0])):
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            a[r] = [u - f * v for u, v in zip(a[r], a[col], strict=True)]
            b[r] -= f * b[col]
    coef = [0.0] * k
    for r in reversed(range(k)):
        coef[r] = (b[r] - sum(a[r][c] * coef[c] for c in range(r + 1, k))) / a[r][r]
    return coef


def estimate_from_sizes(counted: list[tuple[int, float]], elements: int | None) -> float | None:
    """FLOPs for a shape of ``elements`` elements from the shapes counted already
    (``(elements, flops)`` pairs, sizes > 0). Within the counted sizes: a least-squares
    straight line through them (work that grows with the batch's rows or tokens), else,
    from :data:`QUADRATIC_FROM` distinct sizes, a parabola that bends up (attention's
    square term), where it gives each counted shape within :data:`FIT_WITHIN`. Outside
    them, or where neither fits: the nearest counted size's FLOPs scaled by the size (a
    fit's ends run off: attention makes its intercept negative, below the smallest size).
    0 for an empty batch; None where the sizes say nothing (no size, none counted)."""
    if elements is None:
        return None
    if elements == 0:
        return 0.0
    counted = [(n, f) for n, f in counted if n > 0 and math.isfinite(f)]
    if not counted:
        return None
    sizes = sorted({n for n, _ in counted})
    if len(sizes) >= 2 and sizes[0] <= elements <= sizes[-1]:
        scale = float(sizes[-1])  # (x in [0, 1]: the normal equations stay well conditioned)
        points = [(n / scale, f) for n, f in counted]
        for degree in (1, 2) if len(sizes) >= QUADRATIC_FROM else (1,):
            coef = _polyfit(points, degree)
            if coef is None or (degree == 2 and coef[2] < 0):
                continue
            if all(abs(sum(c * x**i for i, c in enumerate(coef)) - f) <= FIT_WITHIN * abs(f) for x, f in points):
                estimate = sum(c * (elements / scale) ** i for i, c in enumerate(coef))
                if estimate >= 0:
                    return estimate
    n_near, f_near = min(counted, key=lambda p: abs(math.log(elements / p[0])))
    return f_near * elements / n_near


def estimate_new_shape(counts: dict[Hashable, Any], key: Hashable) -> tuple[float, bool]:
    """FLOPs for a shape key not counted, from the keys counted (``counts``, not empty):
    :func:`estimate_from_sizes` where every key tells its size, else the counts' mean;
    and whether the sizes gave it. Never raises (a key of any kind may come)."""
    mean = sum(float(f) for f in counts.values()) / len(counts)
    try:
        sized = [(signature_elements(k), float(f)) for k, f in counts.items()]
        if all(n is not None for n, _ in sized):
            by_size = estimate_from_sizes([(n, f) for n, f in sized if n is not None], signature_elements(key))
            if by_size is not None and math.isfinite(by_size):
                return by_size, True
    except (ArithmeticError, ValueError) as e:  # (sizes past a float's range)
        log.debug("no FLOP estimate by size for %r: %s", key, e)
    return mean, False


MAX_ESTIMATES = 4096  # new shapes whose estimated FLOPs are kept (past it, all forgotten at once)


class FlopEstimates:
    """The FLOPs of shapes not counted, from the shapes counted (``cache``: shape key ->
    FLOPs, the callback's), kept per key: every new shape's once ``max_counts`` are
    counted (batches padded to their longest sequence make hundreds), and a step's whose
    shape only its forward told. Training thread only."""

    def __init__(self, cache: dict[Hashable, Any], max_counts: int, warnings: Any) -> None:
        self._cache = cache
        self._max_counts = max_counts
        self._warnings = warnings  # greend.training.warn.OnceWarnings
        self._kept: dict[Hashable, float] = {}

    def estimate(self, key: Hashable | None) -> float:
        """The shape's FLOPs (see estimate_new_shape); 0 while nothing is counted."""
        estimate = self._kept.get(key)
        if estimate is None:
            if not self._cache:
                return 0.0
            estimate, fitted = estimate_new_shape(self._cache, key)
            if len(self._kept) >= MAX_ESTIMATES:
                self._kept.clear()  # (each estimate is made again once: about 0.1 ms)
            self._kept[key] = estimate
            if "flopcache" not in self._warnings and len(self._cache) >= self._max_counts:
                how = "are estimated by their size from the counted ones" if fitted else "reuse the mean FLOP count"
                self._warnings.warn(
                    "flopcache",
                    f"more than {self._max_counts} distinct input shapes: new shapes {how} "
                    "(pass shape_key= buckets, max_flop_counts= or flops_per_step= for exact counts)",
                    level=logging.INFO,
                )
        return estimate

    def store(self, key: Hashable | None, counted: int | None) -> int:
        """A shape's count, kept (the estimates forgotten: a new count moves the line)."""
        if counted is None:
            return 0
        self._kept.clear()
        self._cache[key] = counted
        log.debug("counted %d FLOPs per step for shape key %r", counted, key)
        return counted
