"""Chapter 14's memory plot, drawn by make.py from real runs of the chapter's own script.

`course/14_context_parallel/ring_attention.py -n P` measures, with chapter 8's ActivationMeter,
the peak activation bytes one process holds (plain attention keeps the S x S probabilities),
ring attention in one process, and each CP rank, at three sequence lengths. The figure runs it
at CP 2, 3 and 4 and draws the per-rank peak against the sequence: counted bytes, not times, so
a busy machine draws the same lines.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "course" / "14_context_parallel" / "ring_attention.py"
ROW = re.compile(r"seq +(\d+): one process +(\d+) KiB, ring attention alone +(\d+) KiB, "
                 r"CP \d per rank \(most\) +(\d+) KiB")


def measured(p: int) -> list[tuple[int, int, int, int]]:
    """(sequence, one process, ring alone, CP p per rank) KiB rows of the script at CP p."""
    done = subprocess.run([sys.executable, str(SCRIPT), "-n", str(p)], capture_output=True,
                          text=True, timeout=900, check=True)
    return [tuple(map(int, m)) for m in ROW.findall(done.stdout)]


def draw_cp_memory(target: Path, save) -> str:
    """Peak activation KiB per rank against the sequence length: one process, CP 2, 3, 4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {p: measured(p) for p in (2, 3, 4)}
    seqs = [row[0] for row in runs[2]]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(seqs, [row[1] for row in runs[2]], "o-", color="tab:red",
            label="one process, plain attention (S x S kept)")
    ax.plot(seqs, [row[2] for row in runs[2]], "s--", color="tab:gray",
            label="one process, ring attention (blocks)")
    for p, color in ((2, "tab:blue"), (3, "tab:green"), (4, "tab:purple")):
        ax.plot(seqs, [row[3] for row in runs[p]], "o-", color=color, label=f"CP {p}, per rank")
    ax.set(xlabel="sequence length (tokens)", ylabel="peak activation KiB per rank",
           xticks=seqs, title="Context parallelism: each rank holds 1/CP of the activations")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, target)
    return "python course/14_context_parallel/ring_attention.py -n 2|3|4 (the memory rows)"
