"""Small Python values between ranks without pickle: JSON and raw tensors, nothing else.

torch's `all_gather_object`, `gather_object` and `broadcast_object_list` pickle what they send
and unpickle what arrives: whoever can put bytes on a rank's connection can run code on it (the
class of CVE-2024-5480). These do the same jobs in a format that can only describe data: the
value as JSON, in which every tensor is replaced by a reference to its dtype, shape and raw
bytes, sent after the JSON. A tuple arrives as a list (JSON has one kind of sequence): callers
unpack or compare element-wise, which is the same for both. Anything else (a class, a function)
is refused on the sending rank, before a byte moves.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
import torch.distributed as dist

from ..errors import MicroDDPError
from ..world.world import group_size, uses_nccl

_TENSOR = "__microddp_tensor__"
_HEAD = struct.Struct("!Q")  # the JSON part's length; the tensors' bytes follow it
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def encode(value: Any) -> bytes:
    """`value` (JSON types, tuples and CPU or GPU tensors, nested) as bytes."""
    blobs: list[bytes] = []

    def swap(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            name = str(v.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise MicroDDPError(f"a tensor of dtype {name} cannot travel between ranks here")
            t = v.detach().to("cpu").contiguous()
            blobs.append(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
            return {_TENSOR: [len(blobs) - 1, name, list(t.shape)]}
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise MicroDDPError("a dict sent between ranks needs string keys")
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [swap(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise MicroDDPError(f"a {type(v).__name__} cannot be sent between ranks (only JSON "
                            "values and tensors travel, never pickled objects)")

    text = json.dumps(swap(value), separators=(",", ":")).encode()
    sizes = [len(b) for b in blobs]
    head = json.dumps(sizes).encode()
    return _HEAD.pack(len(text)) + _HEAD.pack(len(head)) + text + head + b"".join(blobs)


def decode(data: bytes) -> Any:
    """The value `encode` made; MicroDDPError for bytes that are not such a value."""
    try:
        (n_text,), (n_head,) = _HEAD.unpack_from(data, 0), _HEAD.unpack_from(data, 8)
        at = 16
        tree = json.loads(data[at:at + n_text])
        sizes = json.loads(data[at + n_text:at + n_text + n_head])
        at += n_text + n_head
        starts = [at + sum(sizes[:i]) for i in range(len(sizes))]
    except (struct.error, ValueError, TypeError) as e:
        raise MicroDDPError(f"a value from another rank is not in microddp's format ({e})") \
            from None

    def back(v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {_TENSOR}:
            i, name, shape = v[_TENSOR]
            raw = data[starts[i]:starts[i] + sizes[i]]
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
                torch.empty(0, dtype=torch.uint8)
            return flat.view(_DTYPES[name]).reshape(shape).clone()
        if isinstance(v, dict):
            return {k: back(x) for k, x in v.items()}
        if isinstance(v, list):
            return [back(x) for x in v]
        return v

    try:
        return back(tree)
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise MicroDDPError(f"a value from another rank is not in microddp's format ({e})") \
            from None


def _device(group) -> torch.device:
    # NCCL carries only CUDA tensors; the bytes go by the device this rank works on
    return torch.device("cuda", torch.cuda.current_device()) if uses_nccl(group) else \
        torch.device("cpu")


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def _lengths(n: int, group, device: torch.device) -> list[int]:
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(group_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def all_gather_values(value: Any, group=None) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (all_gather_object without pickle)."""
    device, data = _device(group), encode(value)
    sizes = _lengths(len(data), group, device)
    slots = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(slots, _padded(data, max(sizes), device), group=group)
    return [decode(s[:n].cpu().numpy().tobytes()) for s, n in zip(slots, sizes, strict=True)]


def gather_values(value: Any, dst: int = 0, group=None) -> list[Any] | None:
    """Every rank's `value` on rank `dst` (None elsewhere): gather_object without pickle."""
    device, data = _device(group), encode(value)
    sizes = _lengths(len(data), group, device)
    # dst and src are global ranks, as in torch's own calls
    slots = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in sizes] \
        if dist.get_rank() == dst else None
    dist.gather(_padded(data, max(sizes), device), slots, dst=dst, group=group)
    if slots is None:
        return None
    return [decode(s[:n].cpu().numpy().tobytes()) for s, n in zip(slots, sizes, strict=True)]


def broadcast_value(value: Any, src: int = 0, group=None) -> Any:
    """Rank `src`'s `value` on every rank (broadcast_object_list without pickle)."""
    device = _device(group)
    data = encode(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = _padded(data, int(size.item()), device)
    dist.broadcast(buf, src=src, group=group)
    return decode(buf.cpu().numpy().tobytes())
