"""Tensor and sequence parallelism (microddp.tp) reproduce one process, and PyTorch's own.

For TP = 1, 2, 3, 4: the eval logits of a batch, every loss, the first step's gradients and the
parameters after 3 SGD steps (momentum 0.9, dropout 0.1 seeded) of microddp's TensorParallelGPT
equal one process's GPT, within float32 tolerance (tp_helpers.TOL: the group sums in another
order). Cases: tied embeddings with dropout; sequence parallelism with a vocabulary that does
not divide (250); untied head with an MLP width that does not divide (100). In the same ranks,
PyTorch's parallelize_module (ColwiseParallel / RowwiseParallel / SequenceParallel, on gloo)
trains the same model, split the same way (dropout 0, untied: DTensor's dropout draws its own
masks), and must equal one process too: so microddp equals torch's own TP.
"""

from __future__ import annotations

import pytest
import torch

import microddp as mdp
from microddp import MicroDDPError
from microddp.gpt import GPTConfig
from microddp.tp import TensorParallelGPT, check_split
from tp_helpers import TOL, batches, config, fresh, reference, torch_parallel, train

OURS = [({}, False), ({"vocab_size": 250}, True), ({"tie_embeddings": False, "d_ff": 100}, True)]
THREE = {"n_head": 6, "d_model": 36}  # 3 divides the heads
THEIRS = [({"dropout": 0.0, "tie_embeddings": False}, False),
          ({"dropout": 0.0, "tie_embeddings": False}, True)]


def _ours(cfg, data, sp, group=None):
    tp = TensorParallelGPT(fresh(cfg), group, sp)
    logits, losses, grads = train(tp, data, finish=tp.finish_grads)
    return logits, losses, grads, tp.full_state_dict(), tp.vocab_start


def _ranks(world, extra, with_torch):
    out = {"ours": [_ours(config(**extra, **kw), batches(config(**extra, **kw)), sp)
                    for kw, sp in OURS]}
    if with_torch:
        out["torch"] = [torch_parallel(world, config(**kw), batches(config(**kw)), sp)
                        for kw, sp in THEIRS]
    return out


def _assert_equal(cfg, got, want, what):
    logits, losses, grads, state = got[:4]
    r_logits, r_losses, r_grads, r_state = want
    start = got[4] if len(got) > 4 else 0
    width = min(logits.shape[-1], cfg.vocab_size - start)
    torch.testing.assert_close(logits[..., :width], r_logits[..., start:start + width], **TOL,
                               msg=f"{what}: logits")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(r_losses), **TOL,
                               msg=f"{what}: losses")
    assert set(grads) >= set(r_grads) - {"head.weight"} and set(state) == set(r_state), what
    for name in r_grads:
        if name in grads:
            torch.testing.assert_close(grads[name], r_grads[name], **TOL, msg=f"{what}: grad {name}")
    for name in r_state:
        torch.testing.assert_close(state[name], r_state[name], **TOL, msg=f"{what}: {name}")


def test_tp_one_is_the_model_itself():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only fight the other tests for cores
    try:
        for kw, sp in OURS:
            cfg = config(**kw)
            _assert_equal(cfg, _ours(cfg, batches(cfg), sp), reference(cfg, batches(cfg)),
                          f"tp=1 {kw}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("p", [2, pytest.param(3, marks=pytest.mark.slow),
                               pytest.param(4, marks=pytest.mark.slow)])
def test_tp_equals_one_process_and_torchs_parallelize_module(p):
    extra = THREE if p == 3 else {}
    with_torch = p != 3  # torch's part is the same model: once at 2 and 4 is enough
    ranks = mdp.spawn(_ranks, p, (extra, with_torch), backend="gloo", timeout=300)
    for i, (kw, sp) in enumerate(OURS):
        cfg = config(**extra, **kw)
        want = reference(cfg, batches(cfg))
        for r, out in enumerate(ranks):
            _assert_equal(cfg, out["ours"][i], want, f"microddp tp={p} rank {r} {kw} sp={sp}")
    for i, (kw, sp) in enumerate(THEIRS if with_torch else []):
        cfg = config(**kw)
        want = reference(cfg, batches(cfg))
        for r, out in enumerate(ranks):
            _assert_equal(cfg, out["torch"][i], want, f"torch tp={p} rank {r} sp={sp}")


def test_a_split_that_cannot_be_exact_is_refused_in_one_line():
    with pytest.raises(MicroDDPError, match="n_head 4 does not divide by the tensor-parallel size 3"):
        check_split(GPTConfig(n_head=4, d_model=32), 3)
    check_split(GPTConfig(n_head=4, d_model=32, vocab_size=250, d_ff=100), 4)  # padded instead
