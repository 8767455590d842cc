"""Communication hooks: how a full bucket of gradients becomes its average over ranks.

A hook is `hook(state, bucket) -> torch.futures.Future[Tensor]`, PyTorch's contract: `bucket`
is a GradBucket (`buffer()`, `index()`, `is_last()`, `parameters()`, `gradients()`), the
future's value is the averaged flat tensor. Register one with `ddp.register_comm_hook(state,
hook)`; `state` is what the hook needs (here: the process group, or None for the default one).
PyTorch's own hooks (torch.distributed.algorithms.ddp_comm_hooks) work too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives.hierarchical import chosen
from ..comms import all_reduce, distributed, group_size
from ..errors import MicroDDPError
from ..monitor.patch import failed_wait
from .buckets import Bucket, bucket_view
from .torch_errors import DDPTypeError, DDPValueError, torch_says

Future = torch.futures.Future
CommHook = Callable[[object, "GradBucket"], Future]


class GradBucket:
    """What a communication hook sees of one bucket (the same methods as torch's GradBucket)."""

    def __init__(self, bucket: Bucket, count: int) -> None:
        self._bucket, self._count = bucket, count
        self._buffer = bucket.flat

    def index(self) -> int:
        """The bucket's position in reduction order: bucket 0 is reduced first."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat tensor holding every gradient of the bucket, back to back."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make `tensor` what buffer() and gradients() return from now on, as torch's does
        (fp16_compress_wrapper passes a float16 copy to the hook it wraps this way). The
        bucket's own memory is left alone: the averages are the hook's Future's value."""
        self._buffer = tensor

    def is_last(self) -> bool:
        """True for the bucket reduced last in the backward pass."""
        return self._bucket.index == self._count - 1

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._bucket.params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: a view of buffer(), shaped as the parameter."""
        return [bucket_view(self._buffer, p, o)
                for p, o in zip(self._bucket.params, self._bucket.offsets, strict=True)]

    def offsets(self) -> list[int]:
        """Where each parameter's gradient starts in buffer(), in elements."""
        return list(self._bucket.offsets)

    def lengths(self) -> list[int]:
        """How many elements each parameter's gradient takes in buffer()."""
        return list(self._bucket.lengths)


def check_hook(hook) -> None:
    """Refuse, at registration, a hook that cannot work, with torch's error types and phrases:
    not callable (TypeError), or annotated with a bucket that is not a GradBucket or a result
    that is not a Future (ValueError). Unannotated hooks are checked by their result."""
    if not callable(hook):
        raise DDPTypeError(torch_says(
            "Communication hook must be callable.",
            f"It is called as hook(state, bucket) and returns a Future; got {hook!r}."))
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: its result is checked
        return
    params = list(sig.parameters.values())
    bucket = (sig.parameters["bucket"] if "bucket" in sig.parameters
              else params[1] if len(params) > 1 else None)
    if bucket is not None and not _names(bucket.annotation, (dist.GradBucket, GradBucket),
                                         "GradBucket"):
        raise DDPValueError(torch_says(
            "Communication hook: bucket annotation should be dist.GradBucket.",
            f"The hook's bucket is annotated {bucket.annotation!r}; annotate it "
            "dist.GradBucket, or leave it unannotated."))
    if not _names(sig.return_annotation, (torch.futures.Future[torch.Tensor], Future),
                  "Future"):
        raise DDPValueError(torch_says(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor].",
            f"The hook is annotated to return {sig.return_annotation!r}; a hook returns a "
            "Future whose value is the averaged bucket."))


def _names(annotation, types: tuple, word: str) -> bool:
    """Whether `annotation` is empty, one of `types`, or a string naming `word` (a module with
    `from __future__ import annotations` has strings, which torch's own check refuses)."""
    if annotation is inspect.Parameter.empty or any(annotation == t for t in types):
        return True
    return isinstance(annotation, str) and annotation.split("[")[0].endswith(word)


def check_future(hook: CommHook, fut) -> Future:
    """`fut`, what `hook` returned, if it is a Future (torch's contract for comm hooks)."""
    if not isinstance(fut, torch._C.Future):  # the base of torch.futures.Future and .then()'s
        name = getattr(hook, "__name__", repr(hook))
        raise MicroDDPError(torch_says(
            f"callback must return a torch.futures.Future object, but got {type(fut).__name__}:",
            f"comm hook {name} returned {type(fut).__name__}; return e.g. "
            "dist.all_reduce(bucket.buffer(), async_op=True).get_future() or, for a result "
            "already computed, a Future with set_result(tensor)"))
    return fut


def done(value) -> Future:
    """A future that has already finished with `value`."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def sum_future(tensor: torch.Tensor, group=None) -> Future:
    """Start an all-reduce (sum) of `tensor` in place; the future's value is the tensor.
    Through microddp.comms: shared memory when the group's ranks share this host."""
    if group_size(group) == 1:
        return done(tensor)
    return all_reduce(tensor, group=group, async_op=True, checked=False).get_future().then(
        lambda fut: fut.value()[0])


class Summing:
    """An all-reduce (sum) in flight that, unlike a chained Future, runs no Python when it
    completes: the default path of the reducer, where every bucket counts. Through
    microddp.comms, so shared memory when the group's ranks share this host.

    `now`: run it to the end before returning, on this thread (then it is a finished
    Summing). For a bucket with no backward work left to hide it behind: an asynchronous call
    hands the bucket to another thread and back (shared memory's lane, or gloo's), which
    costs more than the call itself for a small bucket on a busy core (reducer.py)."""

    def __init__(self, tensor: torch.Tensor, group=None, now: bool = False) -> None:
        self.tensor = tensor
        self.work = None
        if distributed(group):
            self.work = all_reduce(tensor, group=group, async_op=not now, checked=False)

    def wait(self) -> torch.Tensor:
        """Wait for the sum to arrive and return the summed tensor."""
        if self.work is not None:
            self.work.wait()
        return self.tensor

    def add_done_callback(self, fn: Callable) -> None:
        """Call `fn` with a finished future once the sum has arrived (at once if it already has)."""
        if self.work is None:
            fn(done(self.tensor))
        else:
            self.work.get_future().add_done_callback(fn)


def finish(reduction: Future | Summing):
    """Wait for a bucket's reduction (start_reduction) and return its value. A comm hook's
    future, chained with .then(), fails with the backend's bare error when the all-reduce
    under it does: that becomes the hang report too, as a failed Summing's wait does."""
    try:
        return reduction.wait()
    except RuntimeError as e:
        raise failed_wait(e) from None


def start_reduction(bucket: Bucket, count: int, group, hook: CommHook | None,
                    state: object, now: bool = False) -> Future | Summing:
    """Start summing `bucket` (one of `count`) over `group`: the plain all-reduce, or the
    registered comm `hook`, whose result must be a Future. The reducer starts each bucket
    this way, and so does Join on a rank that shadows the others' collectives. `now`: the
    plain all-reduce runs to the end on this thread (`Summing`); hooks and the hierarchy
    are started as always."""
    if hook is None:
        hierarchy = chosen(group)  # decided when the DDP was built (collectives.hierarchical)
        return (Summing(bucket.flat, group, now) if hierarchy is None
                else hierarchy.start(bucket.flat))
    return check_future(hook, hook(state, GradBucket(bucket, count)))


def allreduce(state, bucket: GradBucket) -> Future:
    """Average the bucket: divide by the number of ranks, then sum over ranks (what DDP does)."""
    flat = bucket.buffer()
    flat.div_(group_size(state))
    return sum_future(flat, state)


def _compressed(dtype: torch.dtype) -> CommHook:
    def hook(state, bucket: GradBucket) -> Future:
        flat = bucket.buffer()
        small = flat.to(dtype).div_(group_size(state))  # divide first: no overflow in the sum

        def restore(fut: Future) -> torch.Tensor:
            return flat.copy_(fut.value())

        return sum_future(small, state).then(restore)

    return hook


fp16_compress = _compressed(torch.float16)
fp16_compress.__doc__ = "Send gradients as float16 (half the bytes), averaged, then cast back."
bf16_compress = _compressed(torch.bfloat16)
bf16_compress.__doc__ = ("Send gradients as bfloat16 (half the bytes, float32's range), "
                         "averaged, then cast back.")

def ring(state, bucket: GradBucket) -> Future:
    """Average the bucket with microddp's own ring all-reduce (send/recv only): the
    from-scratch DDP over the from-scratch collective. It runs to the end before backward goes
    on (the ring is a blocking call), so it does not overlap."""
    flat = bucket.buffer()
    flat.div_(group_size(state))
    if distributed(state):
        collectives.ring_all_reduce(flat, group=state, check=False)
    return done(flat)


def shm(state, bucket: GradBucket) -> Future:
    """Average the bucket through shared memory, asynchronously (the ranks of the group must
    all be on this host; comms' default path chooses it by itself when they are)."""
    flat = bucket.buffer()
    flat.div_(group_size(state))
    if not distributed(state):
        return done(flat)
    work = collectives.shm_all_reduce(flat, group=state, async_op=True)
    return work.get_future().then(lambda _: flat)


BUILTIN = {"allreduce": allreduce, "fp16_compress": fp16_compress, "bf16_compress": bf16_compress,
           "ring": ring, "shm": shm}
