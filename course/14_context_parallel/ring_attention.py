"""Chapter 14: attention over a sequence split across ranks, exactly. The online softmax merges
blocks of a row; the ring passes key/value blocks from rank to rank; the zigzag split balances a
causal ring; a GPT trained with context parallelism equals one process, also on a sequence that
does not divide (padded); how much of the ring's communication the blocks hide; and the
activation memory each rank holds, measured, against the sequence length.

    python course/14_context_parallel/ring_attention.py          # CP 2
    python course/14_context_parallel/ring_attention.py -n 3
"""

import argparse

import torch
import torch.nn.functional as F

import microddp as mdp
from microddp.cp import (
    ContextParallelGPT,
    block_attention,
    merge,
    pair_kind,
    positions,
    ring_attention,
    shard,
    unshard,
)
from microddp.cp.overlap import measure
from microddp.cp.split import chunks_of, padding
from microddp.gpt import GPT, GPTConfig
from microddp.pipeline.activations import ActivationMeter

LENGTHS = (24, 48, 96)  # divide by 2 * CP for CP = 2, 3, 4
CFG = GPTConfig(vocab_size=64, block_size=max(LENGTHS), n_layer=2, n_head=4, d_model=32)
BATCH, STEPS = 2, 3


def online_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 12, 8, generator=g) for _ in range(3))
    out = lse = None
    for kb, vb in zip(k.chunk(3, -2), v.chunk(3, -2), strict=True):  # three blocks of keys
        o, l_b = block_attention(q, kb, vb, 8 ** -0.5, "full")
        out, lse = merge(out, lse, o, l_b)
    whole = F.scaled_dot_product_attention(q, k, v)
    print(f"online softmax: 3 key blocks merged by log-sum-exp == softmax over the whole row: "
          f"max |diff| {(out - whole).abs().max().item():.1e}")


def data(length=LENGTHS[0]):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (BATCH, length), generator=g),
             torch.randint(0, 64, (BATCH, length), generator=g)) for _ in range(STEPS)]


def fresh():
    torch.manual_seed(0)
    return GPT(CFG)


def train(model, step_loss, finish=lambda: None, length=LENGTHS[0]):
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    losses = []
    for x, y in data(length):
        opt.zero_grad()
        losses.append(step_loss(x, y))
        finish()
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def peak_kib(model, loss_of, length):
    x, y = data(length)[0]
    with ActivationMeter(model.parameters()) as meter:
        loss_of(x, y).backward()
    model.zero_grad()
    return meter.peak // 1024


def attention_inputs():
    g = torch.Generator().manual_seed(2)
    return [torch.randn(2, 4, LENGTHS[0], 8, generator=g) for _ in range(4)]


def rank(world):
    torch.set_num_threads(1)
    out = {"attention": []}
    for causal in (True, False):
        q, k, v, dout = attention_inputs()
        mine = [shard(t, 2).clone().requires_grad_() for t in (q, k, v)]
        y = ring_attention(*mine, causal=causal)
        y.backward(shard(dout, 2))
        out["attention"].append((y.detach(), [t.grad for t in mine]))
    model = fresh()
    cp = ContextParallelGPT(model)

    def step(x, y):
        share = cp.loss(x, y)
        share.backward()
        return cp.global_loss(share)
    out["losses"], out["params"] = train(model, step, cp.finish_grads)
    out["memory"] = [peak_kib(model, cp.loss, n) for n in LENGTHS]
    out["overlap"] = measure(cp, *data(LENGTHS[-1])[0])
    model = fresh()
    cp = ContextParallelGPT(model)
    out["padded"] = train(model, step, cp.finish_grads, LENGTHS[0] - 1)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nproc", type=int, default=2, help="context-parallel ranks (2-4)")
    p = parser.parse_args().nproc
    if not 2 <= p <= 4:
        parser.error(f"--nproc must be 2, 3 or 4 (the lengths divide by 2 * CP), got {p}")
    online_softmax()
    for r in range(p):
        print(f"rank {r} holds chunks {chunks_of(r, p)} of {2 * p}: positions "
              f"{positions(LENGTHS[0], r, p).tolist()}")
    for step in range(p):
        blocks = [sum(pair_kind(a, b, True) is not None for a in chunks_of(r, p)
                      for b in chunks_of((r - step) % p, p)) for r in range(p)]
        print(f"causal ring step {step}: chunk blocks computed per rank {blocks}")

    ranks = mdp.spawn(rank, p, backend="gloo", timeout=300)
    for c, causal in enumerate((True, False)):
        q, k, v, dout = attention_inputs()
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        want.backward(dout)
        got = unshard([r["attention"][c][0] for r in ranks], 2)
        gdiff = max((unshard([r["attention"][c][1][i] for r in ranks], 2) - t.grad).abs().max().item()
                    for i, t in enumerate((q, k, v)))
        print(f"ring attention CP {p}, {'causal' if causal else 'full  '}: max |out diff| "
              f"{(got - want).abs().max().item():.1e}, max |dq,dk,dv diff| {gdiff:.1e}")

    model = fresh()

    def step(x, y):
        loss = model.loss(x, y)
        loss.backward()
        return loss.item()
    ref_losses, ref_params = train(model, step)
    ref_memory = [peak_kib(model, model.loss, n) for n in LENGTHS]
    alone = ContextParallelGPT(model)  # a group of one: ring attention without the ring
    ring_memory = [peak_kib(model, alone.loss, n) for n in LENGTHS]
    print(f"one process: losses {' '.join(f'{v:.4f}' for v in ref_losses)}")
    for r, out in enumerate(ranks):
        ldiff = max(abs(a - b) for a, b in zip(out["losses"], ref_losses, strict=True))
        pdiff = max((out["params"][n] - ref_params[n]).abs().max().item() for n in ref_params)
        print(f"CP {p} rank {r}: losses {' '.join(f'{v:.4f}' for v in out['losses'])}, "
              f"max |loss diff| {ldiff:.1e}, max |param diff| after {STEPS} steps {pdiff:.1e}")
    model = fresh()
    ref_padded = train(model, step, length=LENGTHS[0] - 1)
    short = LENGTHS[0] - 1
    for r, out in enumerate(ranks):
        losses, params = out["padded"]
        pdiff = max((params[n] - ref_padded[1][n]).abs().max().item() for n in params)
        print(f"seq {short} (padded by {padding(short, p)} to divide by {2 * p}), rank {r}: max "
              f"|loss diff| {max(abs(a - b) for a, b in zip(losses, ref_padded[0], strict=True)):.1e}"
              f", max |param diff| {pdiff:.1e}")
    for r, out in enumerate(ranks):
        o = out["overlap"]
        print(f"ring at seq {LENGTHS[-1]}, rank {r}: hops alone {o['alone_s'] * 1e3:.2f} ms, "
              f"waited inside forward+backward {o['waited_s'] * 1e3:.2f} ms: "
              f"{o['hidden_pct']:.0f}% hidden behind the blocks")
    print("activation memory (peak bytes autograd and the ring hold, measured):")
    for i, n in enumerate(LENGTHS):
        most = max(out["memory"][i] for out in ranks)
        print(f"  seq {n:3d}: one process {ref_memory[i]:5d} KiB, ring attention alone "
              f"{ring_memory[i]:5d} KiB, CP {p} per rank (most) {most:5d} KiB, "
              f"{most / ring_memory[i]:.3f} of alone")


if __name__ == "__main__":
    main()
