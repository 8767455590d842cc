"""Chapter 6, script 4: mixed precision, bfloat16 on the CPU and why float16 needs a scaler.

    python course/06_training/mixed_precision.py

Autocast runs the matrix multiplications in a 16-bit type and keeps the weights, the loss and
the optimizer in float32. bfloat16 keeps float32's exponent range (8 bits), so small gradients
survive; float16 has 5 exponent bits, so they underflow to zero unless the loss is scaled up
first (GradScaler) and the gradients scaled back down before the step.
"""

import torch
import torch.nn.functional as F

import microddp as mdp
from microddp.data import digits


def train(dtype: torch.dtype | None, steps: int = 60) -> tuple[float, float]:
    """A short run on digits; dtype None means plain float32. Returns (last loss, accuracy)."""
    torch.manual_seed(0)
    model = mdp.FullMLP(64, depth=2, n_classes=10, in_features=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = digits()
    for step in range(steps):
        idx = torch.arange(step * 32, step * 32 + 32) % len(data.train)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = model(data.train.x[idx])
        loss = F.cross_entropy(logits.float(), data.train.y[idx])  # the loss in float32
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(data.test.x).argmax(1) == data.test.y).float().mean().item()
    return loss.item(), acc


def main() -> None:
    layer = torch.nn.Linear(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.ones(2, 8))
    print(f"inside autocast: weights {layer.weight.dtype}, matmul output {out.dtype}")

    tiny = 1e-8  # a typical late-training gradient entry
    print(f"a gradient of {tiny:g} stored as float16: {torch.tensor(tiny).half().item():g}, "
          f"as bfloat16: {torch.tensor(tiny).bfloat16().item():.3g}")
    scale = 2.0 ** 16
    scaled = torch.tensor(tiny * scale).half()
    print(f"float16 after scaling the loss by {scale:g}: {scaled.item():.4g}, "
          f"scaled back in float32: {scaled.float().item() / scale:.3g}")
    print("  -> float16 training needs torch.amp.GradScaler (and CUDA); bfloat16 does not")

    loss32, acc32 = train(None)
    loss16, acc16 = train(torch.bfloat16)
    print(f"60 steps in float32 : loss {loss32:.4f}, test accuracy {100 * acc32:.1f}%")
    print(f"60 steps in bfloat16: loss {loss16:.4f}, test accuracy {100 * acc16:.1f}%")


if __name__ == "__main__":
    main()
