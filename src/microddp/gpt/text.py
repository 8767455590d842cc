"""Text that ships with Python: the bytes of the standard library's own source files.

No download: the top-level `*.py` files of this interpreter's standard library, in sorted
order, are read once, joined with a NUL byte between files, and cached as one array of bytes
under a cache directory (`MICRODDP_CACHE`, else ~/.cache/microddp), named by the Python
version and a hash of the file list, so a second run reads one file. The vocabulary is the
256 byte values: no tokenizer to build or ship.

The split is a fixed rule, not a random draw: every tenth file in sorted order (the 0th, 10th,
...) is validation, the rest training, so the same text is held out on every run and host of
one Python version, whatever the seed.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MicroDDPError

VALIDATION_EVERY = 10  # file i (in sorted order) is validation when i % 10 == 0
SEPARATOR = b"\0"


def _sources(limit_bytes: int | None) -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise MicroDDPError("no standard-library source found under "
                            f"{sysconfig.get_paths()['stdlib']}: text data needs Python's .py files")
    if limit_bytes is None:
        return files
    kept, total = [], 0
    for f in files:
        if total >= limit_bytes:
            break
        kept.append(f)
        total += f.stat().st_size
    return kept


def cache_dir() -> Path:
    """Where the encoded text is kept: $MICRODDP_CACHE, else ~/.cache/microddp."""
    return Path(os.environ.get("MICRODDP_CACHE", Path.home() / ".cache" / "microddp"))


def stdlib_text(limit_bytes: int | None = None,
                cache: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors (uint8) of the standard library's source.

    `limit_bytes` keeps the first files in sorted order until about that many bytes (a
    smaller, quicker corpus); the split rule applies to the files kept.
    """
    files = _sources(limit_bytes)
    key = hashlib.sha256("\n".join(f"{f.name}:{f.stat().st_size}" for f in files).encode())
    where = (cache or cache_dir()) / f"stdlib-py{sysconfig.get_python_version()}-{key.hexdigest()[:12]}"
    # Not with_suffix: the name's "3.12-..." has a dot, which with_suffix would cut the key at.
    parts = {s: where.with_name(f"{where.name}.{s}.bin") for s in ("train", "val")}
    if not all(p.exists() for p in parts.values()):
        chunks: dict[str, list[bytes]] = {"train": [], "val": []}
        for i, f in enumerate(files):
            chunks["val" if i % VALIDATION_EVERY == 0 else "train"].append(f.read_bytes())
        where.parent.mkdir(parents=True, exist_ok=True)
        for split, path in parts.items():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(SEPARATOR.join(chunks[split]))
            os.replace(tmp, path)  # atomic: ranks building the cache at once never read half a file
    return tuple(torch.frombuffer(bytearray(parts[s].read_bytes()), dtype=torch.uint8)
                 for s in ("train", "val"))


@dataclass
class TextData:
    """Random windows of `block_size` + 1 bytes: inputs and the next byte of each position."""

    train: torch.Tensor
    val: torch.Tensor
    block_size: int

    @classmethod
    def load(cls, block_size: int, limit_bytes: int | None = None,
             cache: Path | None = None) -> TextData:
        """The cached standard-library text (built on first use), as windows of `block_size`."""
        train, val = stdlib_text(limit_bytes, cache)
        for name, data in (("train", train), ("validation", val)):
            if len(data) <= block_size + 1:
                raise MicroDDPError(f"the {name} text has {len(data)} bytes, fewer than "
                                    f"block_size + 2 = {block_size + 2}: raise limit_bytes")
        return cls(train, val, block_size)

    def batch(self, split: str, batch_size: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (batch_size, block_size) int64; y is x shifted by one byte."""
        data = {"train": self.train, "val": self.val}[split]
        starts = torch.randint(len(data) - self.block_size - 1, (batch_size,), generator=generator)
        rows = torch.stack([data[s:s + self.block_size + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]

    @staticmethod
    def decode(tokens: torch.Tensor) -> str:
        """Bytes back to text (undecodable bytes replaced)."""
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
