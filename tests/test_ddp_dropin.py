"""What a practitioner brings along when swapping torch's DistributedDataParallel for ours:
- the comm hooks of torch.distributed.algorithms.ddp_comm_hooks, registered on microddp's
  wrapper, give torch's numbers bit for bit (2 ranks);
- changing requires_grad after wrapping (fine-tuning: unfreeze a layer) is refused by name,
  where torch's DDP silently leaves that layer's gradients un-averaged.
"""

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

import microddp as mdp
from microddp import MicroDDPError
from microddp.dp import wrap


def _power_sgd():
    return ps.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                            start_powerSGD_iter=2, random_seed=0)


# name -> (state, hook), made fresh for each run: PowerSGD's state learns as it goes.
TORCH_HOOKS = {
    "allreduce_hook": lambda: (None, dh.allreduce_hook),
    "fp16_compress_hook": lambda: (None, dh.fp16_compress_hook),
    # the wrapper hands its hook a float16 copy through GradBucket.set_buffer
    "fp16_compress_wrapper(allreduce_hook)": lambda: (None,
                                                      dh.fp16_compress_wrapper(dh.allreduce_hook)),
    "powerSGD_hook": lambda: (_power_sgd(), ps.powerSGD_hook),
    "fp16_compress_wrapper(powerSGD_hook)": lambda: (_power_sgd(),
                                                     dh.fp16_compress_wrapper(ps.powerSGD_hook)),
}


def hooked_training(world, engine, name, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(),
                          nn.Linear(48, 4))
    ddp = wrap(model, engine)  # one bucket: PowerSGD waits inside its callbacks, which
    ddp.register_comm_hook(*TORCH_HOOKS[name]())  # gloo runs on too few threads for more
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(world.rank)
    for _ in range(steps):  # PowerSGD compresses from the third step on
        x, y = torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def torch_hooks(world):
    out = {}
    for name in TORCH_HOOKS:
        ours, theirs = (hooked_training(world, "microddp", name),
                        hooked_training(world, "torch", name))
        out[name] = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    return out


def test_torchs_comm_hooks_on_our_wrapper_give_torchs_parameters():
    for same in mdp.spawn(torch_hooks, 2, timeout=120):
        assert same == dict.fromkeys(TORCH_HOOKS, True)


def requires_grad_changed(world, change):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model[0].requires_grad_(change != "unfreeze")
    ddp = mdp.DDP(model)
    g = torch.Generator().manual_seed(world.rank)  # different data: unaveraged grads differ
    model[0].requires_grad_(change == "unfreeze")
    try:
        for _ in range(2):
            ddp(torch.randn(4, 6, generator=g)).sum().backward()
    except MicroDDPError as e:
        return str(e)
    return "no error"


def test_changing_requires_grad_after_wrapping_is_named_on_every_rank():
    for message in mdp.spawn(requires_grad_changed, 2, args=("unfreeze",), timeout=60):
        assert message.startswith("parameter '0.weight' (and 1 more) did not require a gradient "
                                  "when the model was wrapped")
    for message in mdp.spawn(requires_grad_changed, 2, args=("freeze",), timeout=60):
        assert message.startswith("parameter '0.weight' required a gradient when the model was "
                                  "wrapped, and no longer does")
