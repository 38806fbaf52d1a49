"""oneDNN-packed linears: the same numbers as the linears they replace, only where they help."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from torch import nn

from dflash_cli.engine.cpu.packed import PackedLinear, pack_linears
from dflash_cli.engine.load import load_pair

pytestmark = pytest.mark.skipif(PackedLinear.pack(nn.Linear(8, 8)) is None,
                                reason="this torch build has no oneDNN linear")


def test_packed_linears_compute_what_the_linears_do_and_are_skipped_where_they_cannot_help():
    torch.manual_seed(0)
    q, k, v = nn.Linear(48, 80, bias=True), nn.Linear(48, 16, bias=True), nn.Linear(48, 16, bias=True)
    x = torch.randn(2, 5, 48)
    torch.testing.assert_close(PackedLinear.pack(q)(x), q(x), rtol=1e-5, atol=1e-5)
    for got, linear in zip(PackedLinear.pack(q, k, v)(x), (q, k, v), strict=True):  # fused q|k|v
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    assert PackedLinear.pack(q.to(torch.float64)) is None  # only fp32 is packed
    assert PackedLinear.pack(q.float(), nn.Linear(48, 8, bias=False)) is None  # mixed biases
    assert PackedLinear.pack(nn.Identity()) is None


def test_a_packed_drafter_drafts_what_it_drafted_before(tiny_models):
    pair = load_pair(tiny_models["qwen3"], tiny_models["qwen3-drafter"], device=DEVICE, dtype="float32")
    drafter, target = pair.drafter, pair.target
    torch.manual_seed(1)
    context = torch.randn(1, 9, drafter.fc.in_features)
    anchor = torch.tensor([17])

    def draft():
        cache = drafter.new_cache()
        return drafter.draft(context, anchor, 9, drafter.block_size, cache, target.embed_table, target.lm_head)

    before = draft()
    assert pack_linears(drafter) == 1 + 7 * len(drafter.layers)  # fc, then q/k/v/o and the MLP per layer
    assert isinstance(drafter.layers[0].self_attn.q_proj, PackedLinear)
    assert torch.equal(draft(), before)
