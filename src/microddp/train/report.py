"""What a run shows and leaves behind: progress lines, metrics.jsonl, the curves as a PNG.

Only rank 0 reports. Progress is printed as whole lines (no carriage returns), because the
launcher prefixes every line with its rank and a log file keeps every line anyway.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .. import comms, outputs

BAR_WIDTH = 20


def bar(done: int, total: int) -> str:
    """A fixed-width text progress bar for `done` of `total`."""
    filled = BAR_WIDTH * done // max(total, 1)
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


class LossMeter:
    """Training-loss sums: this rank's since the last sync, and every rank's since then.

    `sync` is the only collective; the loop calls it at the same steps on every rank (log
    points, checkpoints), so the totals are identical everywhere and can be saved: `state()`
    goes into a checkpoint, so that a resumed run prints the same losses as one that never
    stopped, its first progress line included.
    """

    def __init__(self, device: torch.device) -> None:
        self.pending = torch.zeros(2, dtype=torch.float64, device=device)
        self.interval = [0.0, 0.0]  # since the last progress line: loss sum, samples
        self.epoch = [0.0, 0.0]  # since the start of the epoch, including before a resume
        # Samples this process trained on, for samples/s: a resumed run did not train the
        # saved ones, so they must not count towards its speed.
        self.fresh = 0.0  # in this epoch
        self.fresh_interval = 0.0  # since the last progress line

    def add(self, loss_sum: torch.Tensor, n: int) -> None:
        """Add a batch's summed loss over `n` samples, without communicating."""
        self.pending[0] += loss_sum.detach().double()
        self.pending[1] += n

    def sync(self) -> None:
        """Sum the pending losses over every rank into the interval's and epoch's totals."""
        comms.all_reduce(self.pending, "sum")
        loss, n = self.pending.tolist()
        self.pending.zero_()
        for acc in (self.interval, self.epoch):
            acc[0] += loss
            acc[1] += n
        self.fresh += n
        self.fresh_interval += n

    def take_interval(self) -> tuple[float, float]:
        """(mean loss, samples trained by this process) since the last call."""
        (loss, n), fresh = self.interval, self.fresh_interval
        self.interval, self.fresh_interval = [0.0, 0.0], 0.0
        return loss / max(n, 1), fresh

    def epoch_mean(self) -> float:
        """The mean training loss per sample of the epoch so far, over every rank."""
        return self.epoch[0] / max(self.epoch[1], 1)

    def state(self) -> dict:
        """What a checkpoint keeps (after a `sync`): the epoch's and the interval's sums."""
        return {"epoch_loss": list(self.epoch), "interval_loss": list(self.interval)}

    def new_epoch(self, saved: dict | None = None) -> None:
        """Start an epoch, or continue one from a checkpoint's `state()`.

        Checkpoints written before the interval was saved lack it: they still resume, and
        only the first progress line after the resume averages fewer steps.
        """
        saved = saved or {}
        self.epoch = list(saved.get("epoch_loss") or [0.0, 0.0])
        self.interval = list(saved.get("interval_loss") or [0.0, 0.0])
        self.fresh = self.fresh_interval = 0.0


class Reporter:
    """Rank 0's voice: prints progress and epoch summaries, appends to metrics.jsonl."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None = None) -> None:
        self.enabled = enabled
        self.metrics_path = out / "metrics.jsonl"
        self.t0 = time.perf_counter()
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            if resume_step is None:
                self.metrics_path.write_text("")
            else:
                self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        """A resumed run repeats the steps after its checkpoint: drop their old lines."""
        if not self.metrics_path.exists():
            return
        rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines()
                if line.strip()]
        kept = [json.dumps(r) for r in rows if r["step"] <= step and r["kind"] != "final"]
        outputs.write_text(self.metrics_path, "".join(line + "\n" for line in kept))

    def say(self, text: str) -> None:
        """Print a line on rank 0."""
        if self.enabled:
            print(text, flush=True)

    def log(self, record: dict) -> None:
        """Append a record with the elapsed time to metrics.jsonl (rank 0 only)."""
        if self.enabled:
            record = {**record, "time": round(time.perf_counter() - self.t0, 4)}
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def progress(self, epoch: int, epochs: int, done: int, total: int, step: int,
                 loss: float, samples_per_s: float) -> None:
        """Print the progress line: epoch, bar, step, loss, throughput."""
        self.say(f"epoch {epoch + 1}/{epochs} {bar(done, total)} {done}/{total} steps  "
                 f"step {step}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s")

    def epoch_summary(self, epoch: int, epochs: int, train_loss: float, acc: float,
                      samples_per_s: float, seconds: float, val_loss: float | None = None) -> None:
        """Print an epoch's training loss, test accuracy (and validation loss) and throughput."""
        val = f"val loss {val_loss:.4f}  " if val_loss is not None else ""
        self.say(f"epoch {epoch + 1}/{epochs}: train loss {train_loss:.4f}  {val}"
                 f"test accuracy {100 * acc:.2f}%  {samples_per_s:,.0f} samples/s  "
                 f"({seconds:.1f} s)")


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, png_path: Path) -> Path | None:
    """Training loss per logged step and test accuracy per epoch, side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the run itself is complete without its picture
    rows = read_metrics(metrics_path)
    steps = [(r["step"], r["loss"]) for r in rows if r["kind"] == "step"]
    epochs = [(r["epoch"], 100 * r["test_accuracy"]) for r in rows if r["kind"] == "epoch"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    if steps:
        ax_loss.plot([s for s, _ in steps], [v for _, v in steps], marker=".")
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="Loss")
    ax_loss.set_yscale("log")
    if epochs:
        ax_acc.plot([e for e, _ in epochs], [a for _, a in epochs], marker="o")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="Test accuracy")
    ax_acc.grid(True, alpha=0.3)
    ax_loss.grid(True, alpha=0.3)
    fig.tight_layout()
    with outputs.atomic(png_path) as tmp:  # a reader never sees half a PNG
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return png_path
