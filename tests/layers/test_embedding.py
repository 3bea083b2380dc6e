"""Packed embedding rows dequantized in torch (traceable by torch.compile) equal gguf's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tokenhaul.layers.embedding import Embedding
from tokenhaul.layers.gguf_weight import GGUFWeight


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_1])
def test_packed_rows_equal_gguf(qtype):
    w = np.random.default_rng(0).standard_normal((50, 128)).astype(np.float32)
    blocks = quantize(w, qtype)
    emb = Embedding(GGUFWeight(qtype, (50, 128), blocks), torch.device("cpu"), torch.float32)
    ids = torch.tensor([0, 7, 49, 7])
    ref = dequantize(blocks[ids.numpy()], qtype).reshape(4, 128)
    assert torch.equal(emb(ids), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
