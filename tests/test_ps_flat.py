"""FlatModel against the plain model it was made from: the same forward, the same gradients
(accumulated by backward into the flat buffer, which is the message a worker sends), an
optimizer step that moves the flat buffer in place to the plain model's parameters, and a
refusal in one line for a model a float32 message cannot carry."""

import copy

import pytest
import torch
import torch.nn.functional as F

from microddp.errors import MicroDDPError
from microddp.model import FullMLP
from microddp.ps.flat import FlatModel


def _models():
    torch.manual_seed(0)
    plain = FullMLP(16, depth=2, n_classes=5, in_features=8)
    return plain, copy.deepcopy(plain)


def test_gradients_and_an_sgd_step_match_the_plain_model():
    plain, model = _models()
    flat = FlatModel(model, extra=1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(12, 8), torch.randint(0, 5, (12,))
    for _ in range(3):  # gradients zeroed in place between steps, as a worker does
        opt_plain.zero_grad()
        flat.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        F.cross_entropy(model(x), y).backward()
        want = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
        torch.testing.assert_close(flat.grads[:flat.numel], want, rtol=0, atol=0)
        assert flat.grads[flat.numel] == 0  # the extra slot is the caller's
        opt_plain.step()
        opt.step()
        want = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
        torch.testing.assert_close(flat.params, want, rtol=0, atol=0)


def test_writing_the_flat_buffer_is_writing_the_model():
    plain, model = _models()
    flat = FlatModel(model)
    flat.params.copy_(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]) * 2)
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.detach(), 2 * p.detach())
    model.load_state_dict(plain.state_dict())  # a resumed server loads into the views
    torch.testing.assert_close(flat.params, torch.cat([p.detach().reshape(-1)
                                                       for p in plain.parameters()]))


def test_a_model_that_is_not_float32_is_refused_in_one_line():
    with pytest.raises(MicroDDPError, match="float32 on the CPU") as e:
        FlatModel(torch.nn.Linear(2, 2).double())
    assert "\n" not in str(e.value)
