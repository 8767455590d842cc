"""The `microddp` process group: torch.distributed's collectives through microddp's shared memory.

A Python subclass of `torch.distributed.ProcessGroup`, built by torch for every group made with
the `microddp` backend. Each group holds two channels: shared memory (shm/group.py, its calls
kept in order by shm/lane.py), set up only if every rank is on this host (shm/attach.py decides
from the ranks' host identities; MICRODDP_TRANSPORT=auto|shm|gloo forces it), and a gloo group
formed beside it and registered as its backend, which takes everything this class does not
override (reduce, gather, scatter, all_to_all, send/recv, ...) through torch's own dispatch.

Shared memory carries all_reduce, broadcast, all_gather, reduce_scatter and barrier of one
dense contiguous CPU tensor of a known dtype; float sums and products on 3+ ranks stay on gloo
(collectives/route.py: this backend gives gloo's bits wherever it takes a call). Every
shared-memory call is asynchronous on the group's lane, so DDP's buckets overlap its backward.
`calls` counts what the group was asked for, by (op, "shm" or "gloo").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..collectives.route import OPS, carries, gives_gloos_bits
from ..errors import MicroDDPError
from ..shm import checked as shm_checked
from ..shm.agreement import Check
from ..shm.collectives import flat_data, open_shared
from ..shm.group import SharedGroup
from ..world.args import op_name
from . import call_forms as forms
from .work import LaneWork

BackendType = dist.ProcessGroup.BackendType


_NO_OP = object()  # _takes: a call that takes no reduce op (broadcast, all_gather, barrier)


class MicroDDPProcessGroup(dist.ProcessGroup):
    """A group whose CPU collectives go through shared memory on one host, and gloo otherwise."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 group_name: str = "") -> None:
        # (rank, size): torch 2.13 builds a Python subclass only from these; the store is
        # for gloo and for shared memory's set-up
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), BackendType.GLOO, self.gloo)
        self._set_default_backend(BackendType.GLOO)
        self.calls: Counter[tuple[str, str]] = Counter()
        # As microddp's own groups set theirs up (shm/collectives.py), under a kind of its own
        # in the store: a world made again after destroy_process_group reuses the names (and,
        # under torchrun, the store) of the first, and each set-up gets a prefix of its own.
        state = (open_shared(store, "backend", group_name or "world", rank, size,
                             timeout.total_seconds()) if size > 1 else None)
        self._state = state
        self.shared: SharedGroup | None = state.group if state is not None else None
        self._lane = state.lane if state is not None else None
        # on 2 ranks x0 + x1 is gloo's sum to the bit; beyond, only if asked (route.py)
        self.any_order = state is not None and state.any_order

    def getBackendName(self) -> str:  # noqa: N802 (torch's name for it)
        """What `dist.get_backend(group)` answers."""
        return "microddp"

    # -- which channel a call takes --------------------------------------------------------

    def _takes(self, tensors: list[torch.Tensor], op: str | None | object = _NO_OP) -> bool:
        """Whether shared memory carries this call: one tensor it can carry, an op it knows
        (`op` None: one it does not, PREMUL_SUM; left out: a call without one), and gloo's
        bits (see the module's docstring)."""
        if self.shared is None or len(tensors) != 1 or not carries(tensors[0]):
            return False
        if op is _NO_OP:
            return True
        return op in OPS and gives_gloos_bits(self.any_order, op, tensors[0])

    def _to_gloo(self, name: str) -> dist.Backend:
        self.calls[name, "gloo"] += 1
        return self.gloo

    def _check(self, name: str, tensor, **more) -> Check:
        """The agreement a shared-memory call makes in its first synchronisation
        (shm/checked.py): the ranks must all call `name`, alike."""
        return shm_checked.check(self.shared.agreement, False, name,
                                 shm_checked.tensor_fields(tensor, **more))

    def _to_gloo_agreed(self, name: str, tensor, **more) -> dist.Backend:
        """gloo, for a call shared memory does not carry, once every rank has agreed (in order
        with the group's shared-memory calls) that they all called `name` alike: gloo aborts
        the process on a size mismatch, or returns reinterpreted bytes."""
        if self.shared is not None:
            shm_checked.agree_in_order(self._lane, self.shared.agreement, False, name,
                                       shm_checked.tensor_fields(tensor, **more), None)
        return self._to_gloo(name)

    def _run(self, name: str, body: Callable[[SharedGroup], None], result: list) -> LaneWork:
        self.calls[name, "shm"] += 1
        group = self.shared

        def task(yielding: bool) -> None:
            group.yielding = yielding
            body(group)

        return LaneWork(self._lane.submit(task, result, async_op=True))

    # -- the collectives -------------------------------------------------------------------

    def allreduce(self, tensors=None, opts=None, op=None, timeout=None, *,
                  tensor=None) -> dist.Work:
        """dist.all_reduce; DDP's buckets come here. Every form of torch's (call_forms.py)."""
        tensors, opts = forms.allreduce(tensor if tensors is None else tensors, opts, op,
                                        timeout)
        op = _op(opts.reduceOp)
        takes = self._takes(tensors, op)
        fields = {"op": str(op), "shared_memory": takes, "tensors": len(tensors)}
        if not takes:
            return self._to_gloo_agreed("allreduce", _first(tensors), **fields).allreduce(
                tensors, opts)
        flat = flat_data(tensors[0])
        size = self.size()
        check = self._check("allreduce", tensors[0], **fields)

        def body(g: SharedGroup) -> None:
            g.all_reduce(flat, op, check)
            if op == "avg":
                flat.div_(size)

        return self._run("allreduce", body, tensors)

    def broadcast(self, tensors=None, opts=None, root=None, timeout=None, *,
                  tensor=None) -> dist.Work:
        """dist.broadcast; DDP's construction sends rank 0's parameters and buffers here."""
        tensors, opts = forms.broadcast(tensor if tensors is None else tensors, opts, root,
                                        timeout)
        # a root outside the group goes to gloo too, which refuses it in its own words
        takes = (opts.rootTensor == 0 and 0 <= opts.rootRank < self.size()
                 and self._takes(tensors))
        fields = {"src": opts.rootRank, "shared_memory": takes, "tensors": len(tensors)}
        if not takes:
            return self._to_gloo_agreed("broadcast", _first(tensors), **fields).broadcast(
                tensors, opts)
        flat, root = flat_data(tensors[0]), opts.rootRank
        check = self._check("broadcast", tensors[0], **fields)
        return self._run("broadcast", lambda g: g.broadcast(flat, root, check), tensors)

    def allgather(self, output_tensors=None, input_tensors=None, opts=None, timeout=None, *,
                  input_tensor=None) -> dist.Work:
        """dist.all_gather; DDP's check that every rank has the same parameter shapes too."""
        output_lists, inputs, opts = forms.allgather(
            output_tensors, input_tensor if input_tensors is None else input_tensors, opts,
            timeout)
        takes = (self._takes(inputs) and len(output_lists) == 1
                 and _alike(output_lists[0], inputs[0], self.size()))
        fields = {"shared_memory": takes, "tensors": len(inputs)}
        if not takes:
            return self._to_gloo_agreed("allgather", _first(inputs), **fields).allgather(
                output_lists, inputs, opts)
        outputs, flat = [flat_data(t) for t in output_lists[0]], flat_data(inputs[0])
        check = self._check("allgather", inputs[0], **fields)
        # gloo's result(): the outputs as one flat list
        return self._run("allgather", lambda g: g.all_gather(outputs, flat, check),
                         output_lists[0])

    def reduce_scatter(self, output_tensors=None, input_tensors=None, opts=None, op=None,
                       timeout=None, *, output=None, input=None) -> dist.Work:  # noqa: A002
        """dist.reduce_scatter (a list of inputs per rank)."""
        outputs, input_lists, opts = forms.reduce_scatter(
            output if output_tensors is None else output_tensors,
            input if input_tensors is None else input_tensors, opts, op, timeout)
        op = _op(opts.reduceOp)
        takes = (self._takes(outputs, op) and len(input_lists) == 1
                 and _alike(input_lists[0], outputs[0], self.size()))
        fields = {"op": str(op), "shared_memory": takes, "tensors": len(outputs)}
        if not takes:
            return self._to_gloo_agreed("reduce_scatter", _first(outputs), **fields
                                        ).reduce_scatter(outputs, input_lists, opts)
        flat, inputs, size = flat_data(outputs[0]), [flat_data(t) for t in input_lists[0]], self.size()
        check = self._check("reduce_scatter", outputs[0], **fields)

        def body(g: SharedGroup) -> None:
            g.reduce_scatter(flat, inputs, op, check)
            if op == "avg":
                flat.div_(size)

        return self._run("reduce_scatter", body, outputs)

    def barrier(self, opts=None, timeout=None) -> dist.Work:
        """dist.barrier: behind every call issued before it, on both channels. gloo's barrier
        waits for the calls this group sent to gloo; then an all-reduce of one number on the
        lane, behind the calls sent to shared memory."""
        opts = forms.barrier(opts, timeout)
        if self.shared is None:
            return self._to_gloo("barrier").barrier(opts)
        gloo = self.gloo.barrier(opts)
        token = torch.zeros(1, dtype=torch.int32)

        check = self._check("barrier", None)

        def body(g: SharedGroup) -> None:
            gloo.wait()
            g.all_reduce(token, "max", check)

        return self._run("barrier", body, [])

    # -- the end ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the shared memory (a peer still waiting raises at once), then gloo's group
        (dist.destroy_process_group calls it)."""
        if self._state is not None:
            self._state.close()
        self._state = self.shared = self._lane = None
        super().shutdown()


def _op(reduce_op) -> str | None:
    """The op's name ("sum", "avg", ...), or None for one microddp does not know (PREMUL_SUM):
    gloo then answers it as it would answer a gloo group."""
    try:
        return op_name(reduce_op)
    except MicroDDPError:
        return None


def _first(tensors: list[torch.Tensor]):
    """The call's tensor the ranks compare (None for an empty list)."""
    return tensors[0] if tensors else None


def _alike(tensors: list[torch.Tensor], like: torch.Tensor, size: int) -> bool:
    """One tensor per rank, each carried by shared memory and of `like`'s shape and dtype
    (anything else goes to gloo, which answers it as it answers a gloo group)."""
    return len(tensors) == size and all(
        carries(t) and t.shape == like.shape and t.dtype == like.dtype for t in tensors)
