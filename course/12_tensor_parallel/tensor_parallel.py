"""Chapter 12: the GPT split over TP ranks, with and without sequence parallelism, against one
process: the same losses and parameters, what each step sends, and the activation memory.

    python course/12_tensor_parallel/tensor_parallel.py          # TP 2
    python course/12_tensor_parallel/tensor_parallel.py -n 4

The model has a vocabulary of 250 (not a multiple of 4: padded, exactly), tied embeddings
and dropout 0.1, seeded so every rank drops what one process drops.
"""

import argparse

import torch

import microddp as mdp
from microddp.gpt import GPT, GPTConfig
from microddp.pipeline.activations import ActivationMeter
from microddp.tp import TensorParallelGPT, counting

CFG = GPTConfig(vocab_size=250, block_size=16, n_layer=2, n_head=4, d_model=32, dropout=0.1)
BATCH, SEQ, STEPS = 4, 16, 3


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 250, (BATCH, SEQ), generator=g),
             torch.randint(0, 250, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def fresh():
    torch.manual_seed(0)
    return GPT(CFG)


def train(model, finish=lambda: None):
    model.seed_dropout(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    losses = []
    for x, y in data():
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        finish()
        opt.step()
        losses.append(loss.item())
    return losses


def activations(model, finish=lambda: None):
    x, y = data()[0]
    with ActivationMeter(model.parameters()) as meter:
        model.loss(x, y).backward()
    finish()
    model.zero_grad()
    return meter.peak_saved


def rank(world):
    out = {}
    for sp in (False, True):
        tp = TensorParallelGPT(fresh(), None, sequence_parallel=sp)
        x, y = data()[0]
        with counting() as fwd:
            loss = tp.loss(x, y)
        with counting() as bwd:
            loss.backward()
            tp.finish_grads()
        tp.zero_grad()
        memory = activations(tp, tp.finish_grads)
        losses = train(tp, tp.finish_grads)
        out[sp] = (fwd, bwd, memory, losses, tp.full_state_dict())
    return out


def summary(calls):
    ops: dict[str, list[int]] = {}
    for c in calls:
        ops.setdefault(c.op, []).append(c.bytes)
    return ", ".join(f"{len(b)} {op} ({sum(b) / 1024:.0f} KiB)" for op, b in ops.items()) or "none"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2, help="tensor-parallel ranks (default: 2)")
    p = parser.parse_args().n
    ref = fresh()
    ref_memory = activations(ref)
    ref_losses = train(ref)
    ref_state = ref.state_dict()
    ranks = mdp.spawn(rank, p, backend="gloo")
    print(f"one process: losses {' '.join(f'{v:.4f}' for v in ref_losses)}, "
          f"activations saved {ref_memory / 1024:.0f} KiB")
    for sp in (False, True):
        fwd, bwd, memory, losses, state = ranks[0][sp]
        name = f"TP {p}" + (" + SP" if sp else "")
        diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        print(f"{name:<9}: losses {' '.join(f'{v:.4f}' for v in losses)}, "
              f"max |loss diff| {loss_diff:.1e}, max |param diff| after {STEPS} steps {diff:.1e}")
        print(f"{'':<11}forward sends:  {summary(fwd)}")
        print(f"{'':<11}backward sends: {summary(bwd)}")
        print(f"{'':<11}activations saved per rank {max(r[sp][2] for r in ranks) / 1024:.0f} KiB")
