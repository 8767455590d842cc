"""The transformer (microddp.gpt) against PyTorch's own attention, and its text data's rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from microddp import MicroDDPError
from microddp.gpt import GPT, GPTConfig, TextData, causal_attention
from microddp.gpt.model import SeededDropout
from microddp.gpt.text import VALIDATION_EVERY, stdlib_text


def test_attention_equals_torch_scaled_dot_product():
    g = torch.Generator().manual_seed(0)
    b, s, h, hd = 2, 7, 4, 8
    q, k, v = (torch.randn(b, s, h * hd, generator=g) for _ in range(3))
    ours = causal_attention(q, k, v, hd, SeededDropout(0.0))
    split = [t.view(b, s, h, hd).transpose(1, 2) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*split, is_causal=True).transpose(1, 2).reshape(b, s, -1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_causal_and_tied_and_untrained_loss():
    torch.manual_seed(0)
    m = GPT(GPTConfig())
    assert m.head.weight is m.wte.weight
    idx = torch.randint(0, 256, (2, 16))
    later = idx.clone()
    later[:, 10:] = (later[:, 10:] + 1) % 256
    a, b = m(idx), m(later)
    torch.testing.assert_close(a[:, :10], b[:, :10])   # the future does not leak back
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert abs(m.loss(idx, later).item() - math.log(256)) < 0.5  # near-uniform at init
    assert GPT(GPTConfig(tie_embeddings=False)).head.weight is not None


def test_seeded_dropout_repeats_and_slices():
    d = SeededDropout(0.5)
    x = torch.ones(2, 4, 6)
    d.generator = torch.Generator().manual_seed(3)
    full = d(x)
    d.generator = torch.Generator().manual_seed(3)
    part = d(x[:, 2:], full_shape=(2, 4, 6), index=(slice(None), slice(2, None)))
    torch.testing.assert_close(part, full[:, 2:])
    assert set(full.unique().tolist()) == {0.0, 2.0}


def test_bad_config_is_one_line():
    with pytest.raises(MicroDDPError, match="must divide by n_head"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(MicroDDPError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(MicroDDPError, match="block_size"):
        GPT(GPTConfig())(torch.zeros(1, 17, dtype=torch.long))


def test_text_split_rule_and_cache(tmp_path):
    train, val = stdlib_text(limit_bytes=300_000, cache=tmp_path)
    assert train.dtype == torch.uint8 and len(val) > 0
    cached = sorted(p.name for p in tmp_path.iterdir())
    assert len(cached) == 2
    train2, val2 = stdlib_text(limit_bytes=300_000, cache=tmp_path)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    # The rule: file 0, 10, 20, ... in sorted order is validation.
    import sysconfig
    from pathlib import Path
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    kept, total = [], 0
    for f in files:
        if total >= 300_000:
            break
        kept.append(f)
        total += f.stat().st_size
    want_val = b"\0".join(f.read_bytes() for i, f in enumerate(kept) if i % VALIDATION_EVERY == 0)
    assert bytes(val.tolist()) == want_val
    data = TextData(train, val, 16)
    x, y = data.batch("train", 3, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_few_steps_learn():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only fight the other tests for cores
    torch.manual_seed(0)
    data = TextData.load(16, limit_bytes=200_000)
    m = GPT(GPTConfig())
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    first = None
    for _ in range(30):
        x, y = data.batch("train", 16, g)
        loss = m.loss(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    assert loss.item() < first - 1.0, (first, loss.item())
