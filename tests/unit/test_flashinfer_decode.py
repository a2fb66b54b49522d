"""The FlashInfer decode path: its page-table conversion (runs everywhere) and the kernel against the
PyTorch reference (marker `cuda`; deselected without a GPU, and never run where this was written).
"""
from __future__ import annotations

import math

import pytest
import torch

from kvtune_engine.attention import flashinfer_decode
from kvtune_engine.attention.reference import paged_decode_reference

from test_attention import make_cache


def test_csr_page_table_from_padded_block_tables():
    bt = torch.tensor([[4, 2, 0, 0], [7, 0, 0, 0], [1, 3, 5, 6]])
    lens = torch.tensor([17, 16, 49], dtype=torch.int32)   # 2 blocks (1 in the last), 1 full, 4 (1 in the last)
    indptr, indices, last = flashinfer_decode.csr_page_table(bt, lens, 16)
    assert indptr.tolist() == [0, 2, 3, 7]
    assert indices.tolist() == [4, 2, 7, 1, 3, 5, 6]
    assert last.tolist() == [1, 16, 1]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


@pytest.mark.cuda
@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("hq,hk", [(8, 8), (8, 2), (16, 4)])
def test_flashinfer_decode_matches_reference(bs, hq, hk):
    if not flashinfer_decode.available():
        pytest.fail("flashinfer-python is not installed on this CUDA machine")
    dev = torch.device("cuda")
    lens = [1, bs - 1, bs, 3 * bs + 5, 300]
    kc, vc, bt, _ = make_cache(lens, hk, 128, bs, seed=bs + hq)
    kc, vc, bt = kc.to(dev), vc.to(dev), bt.to(dev)
    q = torch.randn(len(lens), hq, 128, device=dev)
    scale = 1 / math.sqrt(128)
    ref = paged_decode_reference(q, kc, vc, bt, lens, scale)
    fn = flashinfer_decode.FlashInferDecode(dev)
    out = fn(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=dev), scale)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)
    flashinfer_decode.check(fn, dev)
