"""Issue 57: send/recv (and isend/irecv) of a strided view, such as a transpose, on one rank
or both. gloo refuses such a tensor ("input tensor has to be contiguous"), a raw error on one
rank while its peer waits out the timeout; comms sends a contiguous copy and receives into a
buffer copied into the view, so the received view equals the sent one element by element."""

import torch

import microddp as mdp


def sent(k: int) -> torch.Tensor:
    return torch.arange(12.0).reshape(3, 4) + 100 * k  # transposed: a (4, 3) strided view


def exchange(world):
    got = []
    # (sender's view, receiver's view, async): a transpose on either side, or both
    for k, (send_t, recv_t, async_) in enumerate([(True, True, False), (True, False, False),
                                                  (False, True, False), (True, True, True),
                                                  (False, True, True)]):
        if world.rank == 0:
            x = sent(k).T if send_t else sent(k).T.contiguous()
            assert x.is_contiguous() != send_t
            if async_:
                mdp.comms.isend(x, 1).wait()
            else:
                mdp.comms.send(x, 1)
        else:
            buf = torch.full((3, 4), -1.0)
            into = buf.T if recv_t else torch.full((4, 3), -1.0)
            if async_:
                handle = mdp.comms.irecv(into, 0)
                handle.wait()
                assert handle.is_completed()
            else:
                assert mdp.comms.recv(into, 0) == 0
            got.append(torch.equal(into, sent(k).T))
    return got


def test_strided_views_are_sent_and_received_element_by_element():
    ranks = mdp.spawn(exchange, 2, timeout=60)
    assert ranks[1] == [True] * 5, ranks
