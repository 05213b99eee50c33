"""greend.training.flops: CPU attention FLOP formulas, signatures and the 6ND rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from greend.training import flops as gf

aten = torch.ops.aten
B, H, S, D = 2, 4, 16, 8


class TinyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, H * D)


def _per_op(run: object) -> dict[object, int]:
    with FlopCounterMode(display=False) as m:
        run()  # type: ignore[operator]
    return dict(m.get_flop_counts()["Global"])


def test_cpu_attention_forward_and_backward_are_counted() -> None:
    torch.manual_seed(0)
    layer = TinyAttention()
    x = torch.randn(B, S, H * D)
    with FlopCounterMode(display=False) as fwd:
        out = layer(x)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    f = dict(fwd.get_flop_counts()["Global"])
    b = dict(bwd.get_flop_counts()["Global"])
    attn_fwd = f[aten._scaled_dot_product_flash_attention_for_cpu]
    attn_bwd = b[aten._scaled_dot_product_flash_attention_for_cpu_backward]
    assert attn_fwd == 4 * B * H * S * S * D
    assert attn_bwd == 2.5 * attn_fwd  # five matmuls to the forward's two, as torch counts sdpa on CUDA
    # The projection is counted too, so the total is the sum of both.
    assert fwd.get_total_flops() == attn_fwd + 2 * B * S * (H * D) * (3 * H * D)


def test_registration_is_idempotent() -> None:
    assert gf.register_cpu_attention_formulas() == []
    assert aten._scaled_dot_product_flash_attention_for_cpu in torch.utils.flop_counter.flop_registry


def test_count_flops_and_flop_counter() -> None:
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    assert gf.count_flops(lambda: lin(x)) == 2 * 4 * 16 * 8
    c = gf.FlopCounter()
    assert c.start() and c.active
    lin(x)
    assert c.stop() == 2 * 4 * 16 * 8
    assert c.stop() is None and not c.active


def test_model_params_and_six_n_d() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied weights count once
    model = nn.Sequential(emb, head)
    assert gf.model_params(model) == 40
    frozen = nn.Linear(3, 3)
    frozen.requires_grad_(False)
    assert gf.model_params(frozen) == 0 and gf.model_params(frozen, trainable_only=False) == 12
    assert gf.transformer_flops(1000, 50) == 300_000


def test_batch_signature() -> None:
    a, b = torch.zeros(8, 3), torch.zeros(16, 3)
    assert gf.batch_signature(a) == gf.batch_signature(torch.ones(8, 3))
    assert gf.batch_signature(a) != gf.batch_signature(b)
    assert gf.batch_signature(a) != gf.batch_signature(a.half())
    assert gf.batch_signature((a, 3)) == gf.batch_signature((torch.ones(8, 3), 5))
    assert gf.batch_signature({"input_ids": a}) != gf.batch_signature({"input_ids": b})
    hash(gf.batch_signature({"x": [1, 2], "y": a}))


def test_a_nested_batch_s_shapes_are_in_its_signature() -> None:
    """A Lightning batch like ``{"enc": {"ids": (8, L)}, "y": (8,)}`` with padding to the
    longest sequence: its signature held only the inner dict's type name, so every length
    reused the first one's FLOPs (7.5x too few booked). Nested shapes count now, to a bound."""
    a, b = torch.zeros(8, 3), torch.zeros(16, 3)
    short = {"enc": {"ids": torch.zeros(8, 16, dtype=torch.long)}, "y": torch.zeros(8)}
    long = {"enc": {"ids": torch.zeros(8, 128, dtype=torch.long)}, "y": torch.zeros(8)}
    assert gf.batch_signature(short) != gf.batch_signature(long)
    assert gf.batch_signature(short) == gf.batch_signature({"enc": {"ids": torch.ones(8, 16, dtype=torch.long)},
                                                            "y": torch.ones(8)})  # fmt: skip
    assert gf.signature_elements(gf.batch_signature(long)) == 8 * 128 + 8
    assert gf.batch_signature(([a], [b])) != gf.batch_signature(([b], [a]))
    deep = a
    for _ in range(10):
        deep = [deep]
    hash(gf.batch_signature(deep))  # (bounded: a type's name past MAX_DEPTH levels)
    assert gf.batch_rows(long) == 8


def test_the_rows_of_batches_of_many_shapes() -> None:
    """Samples counted from ``batch=``: a list inside a batch counts its items (a detection
    batch of 16 images: 16, not an image's 3 channels), a PackedSequence its sequences, and a
    list of per-sample targets or metadata is left out of the FLOP key (its sizes change no
    FLOPs, and walking it cost each step microseconds)."""
    from torch.nn.utils.rnn import pack_sequence

    imgs = [torch.zeros(3, 32, 32) for _ in range(16)]
    targets = [{"boxes": torch.zeros(i % 5, 4)} for i in range(16)]
    assert gf.batch_rows((imgs, targets)) == 16
    assert gf.batch_rows(pack_sequence([torch.zeros(n) for n in (5, 4, 3, 2)])) == 4
    assert gf.batch_rows({"idx": [1, 2, 3, 4], "x": torch.zeros(4, 2)}) == 4
    assert gf.batch_rows((torch.zeros(9, 4), torch.zeros(9))) == 9 and gf.batch_rows(torch.tensor(1.0)) is None
    assert gf.batch_signature((imgs, targets)) == gf.batch_signature((imgs, targets[::-1]))
    assert gf.batch_signature((imgs, targets)) != gf.batch_signature(([torch.zeros(3, 64, 64)] * 16, targets))


def test_signature_elements_sums_the_tensors_of_a_signature() -> None:
    x, y = torch.zeros(4, 16), torch.zeros(4, dtype=torch.long)
    assert gf.signature_elements(gf.batch_signature(x)) == 64
    assert gf.signature_elements(gf.batch_signature((x, y))) == 68
    assert gf.signature_elements(gf.batch_signature({"input_ids": x, "labels": y, "n": 3})) == 68
    assert gf.signature_elements(128) == 128  # a user's length bucket
    assert gf.signature_elements("long") is None and gf.signature_elements(("a", "b")) is None


def test_a_fit_within_the_counted_sizes_and_the_nearest_scaled_beyond_them() -> None:
    line = [(n, 1000.0 + 7.0 * n) for n in (64, 128, 320, 512)]
    assert gf.estimate_from_sizes(line, 256) == 1000.0 + 7.0 * 256  # the line, within the sizes
    assert gf.estimate_from_sizes(line, 1024) == (1000.0 + 7.0 * 512) * 2  # beyond: the nearest, scaled
    assert gf.estimate_from_sizes(line, 32) == (1000.0 + 7.0 * 64) / 2
    assert gf.estimate_from_sizes(line, None) is None  # a key without a size
    assert gf.estimate_from_sizes(line, 0) == 0.0  # an empty batch
    assert gf.estimate_from_sizes([(64, 10.0), (64, 12.0)], 128) == 20.0  # one size: no slope, scaled
    # Sizes that do not explain the counts (a line misses one by more than 5 %): the nearest, scaled.
    assert gf.estimate_from_sizes([(1, 100.0), (2, 900.0), (3, 150.0)], 2) == 900.0
    # Attention: a square term. A parabola that bends up fits it within the counted sizes; a
    # line through it has a negative intercept, which the smallest shapes no longer meet.
    square = [(n, 50.0 * n + 0.4 * n * n) for n in (64, 96, 128, 256, 512)]
    assert gf.estimate_from_sizes(square, 200) == pytest.approx(50.0 * 200 + 0.4 * 200 * 200, rel=1e-6)
    assert gf.estimate_from_sizes(square, 8) == pytest.approx((50.0 * 64 + 0.4 * 64 * 64) / 8)  # > 0
    # A parabola that bends down (a count that grows slower than the size) is not extrapolated.
    slower = [(n, 1e6 * n**0.8) for n in (64, 128, 256, 384, 512)]
    assert gf.estimate_from_sizes(slower, 4096) == pytest.approx(1e6 * 512**0.8 * 8)
    # And a caller's fallback: the mean where any key has no size; never an error.
    assert gf.estimate_new_shape({"short": 10, "long": 30}, "medium") == (20.0, False)
    assert gf.estimate_new_shape({(2, 8): 160, (4, 8): 320}, (3, 8)) == (240.0, True)
    assert gf.estimate_new_shape({0: 10, -1: 30}, 5) == (20.0, False)  # (a negative key is no size)
    assert gf.estimate_new_shape({1: 10, 2: 20}, 10**400)[1] is False  # past a float: the mean
