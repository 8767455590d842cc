"""FullMLP: the layer stack the issue specifies, and clear errors for impossible shapes."""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import MicroDDPError
from microddp.model import FullMLP


def test_layers_match_the_specification():
    m = FullMLP(8, depth=3, n_classes=5, in_features=6)
    kinds = [type(layer) for layer in m.net]
    assert kinds == [nn.Linear, nn.ReLU] * 3 + [nn.Linear]
    shapes = [tuple(layer.weight.shape) for layer in m.net if isinstance(layer, nn.Linear)]
    assert shapes == [(8, 6), (8, 8), (8, 8), (5, 8)]
    assert m(torch.zeros(4, 6)).shape == (4, 5)


def test_defaults_are_sixteen_layers_two_classes_and_lazy_export():
    m = mdp.FullMLP(4)
    linears = [layer for layer in m.net if isinstance(layer, nn.Linear)]
    assert len(linears) == 17 and linears[0].in_features == 4 and linears[-1].out_features == 2
    assert sum(p.numel() for p in m.parameters()) == 16 * (4 * 4 + 4) + 4 * 2 + 2


def test_forward_equals_the_same_torch_sequential():
    torch.manual_seed(0)
    m = FullMLP(5, depth=2)
    ref = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2))
    ref.load_state_dict({k.removeprefix("net."): v for k, v in m.state_dict().items()})
    x = torch.randn(3, 5)
    assert torch.equal(m(x), ref(x))


@pytest.mark.parametrize("kwargs", [{"dim": 0}, {"dim": 4, "depth": -1}, {"dim": 4, "n_classes": 0},
                                    {"dim": 2.5}])
def test_bad_sizes_raise_a_clear_error(kwargs):
    with pytest.raises(MicroDDPError, match="FullMLP"):
        FullMLP(**kwargs)
