"""Print the equality table of docs/12-tensor-parallel.md: for a TP size, the largest difference
between one process and microddp's TensorParallelGPT (and PyTorch's parallelize_module) in eval
logits, first-step gradients and parameters after 3 SGD steps, on the cases
tests/test_tp_equality.py asserts. Not a test; the test asserts the same runs within tolerance.

    python tests/tp_equality_table.py -n 2
    python tests/tp_equality_table.py -n 4
"""

import argparse

import microddp as mdp
from test_tp_equality import OURS, THEIRS, THREE, _ranks
from tp_helpers import batches, config, reference


def _max(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b if k in a)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2, help="TP ranks (default: 2)")
    p = parser.parse_args().n
    extra = THREE if p == 3 else {}
    ranks = mdp.spawn(_ranks, p, (extra, p != 3), backend="gloo", timeout=600)
    print("| TP | case | max diff logits | grads | params after 3 steps |\n|---|---|---|---|---|")
    rows = [("microddp", kw, sp, "ours", i) for i, (kw, sp) in enumerate(OURS)]
    rows += [("torch", kw, sp, "torch", i) for i, (kw, sp) in enumerate(THEIRS)] if p != 3 else []
    for who, kw, sp, key, i in rows:
        cfg = config(**(extra if who == "microddp" else {}), **kw)
        r_logits, _, r_grads, r_state = reference(cfg, batches(cfg))
        worst = [0.0, 0.0, 0.0]
        for out in ranks:
            logits, _, grads, state = out[key][i][:4]
            start = out[key][i][4] if who == "microddp" else 0
            width = min(logits.shape[-1], cfg.vocab_size - start)
            d = [(logits[..., :width] - r_logits[..., start:start + width]).abs().max().item(),
                 _max(grads, r_grads), _max(state, r_state)]
            worst = [max(a, b) for a, b in zip(worst, d, strict=True)]
        case = f"{who} {kw or 'tied, dropout 0.1'}{' + SP' if sp else ''}"
        print(f"| {p} | {case} | {worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} |")
