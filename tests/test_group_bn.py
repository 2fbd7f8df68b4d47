"""GroupBatchNorm over replicas that share a micro-batch equals BatchNorm on the whole of it."""
import threading

import pytest
import torch
from torch import nn

from swarm.execution.group_bn import GroupBatchNorm


def _group_exchange(g: int):
    """An exchange per member for g threads: each call returns every member's tensors, in order."""
    barrier = threading.Barrier(g)
    board: dict = {}

    def make(i: int):
        def exchange(tag, tensors):
            board[(tag, i)] = tensors
            barrier.wait()
            out = [board[(tag, j)] for j in range(g)]
            barrier.wait()
            return out
        return exchange
    return [make(i) for i in range(g)]


def _run(fn, g: int):
    errors = []

    def guarded(i):
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(g)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors


@pytest.mark.parametrize("shape, splits, affine", [
    ((6, 5, 7, 9), [2, 3, 1], True),
    ((4, 3, 5, 5), [1, 1, 1, 1], True),
    ((5, 4, 6, 6), [3, 0, 2], True),  # a member with no samples of this micro-batch
    ((6, 8), [4, 2], True),          # connected layers: (batch, features)
    ((4, 3, 5, 5), [2, 2], False),
])
def test_group_batchnorm_equals_batchnorm_on_the_whole_micro_batch(shape, splits, affine):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64) * 3 + 1
    dy = torch.randn(*shape, dtype=torch.float64)
    channels = shape[1]
    ref = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(channels, affine=affine).double()
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(dy)

    g = len(splits)
    bounds = [sum(splits[:i]) for i in range(g + 1)]
    exchanges = _group_exchange(g)
    members = []
    for i in range(g):
        bn = nn.BatchNorm2d(channels, affine=affine).double()
        if affine:
            with torch.no_grad():
                bn.weight.copy_(ref.weight)
                bn.bias.copy_(ref.bias)
        member = GroupBatchNorm(bn)
        member.exchange = exchanges[i]
        members.append(member)
    xs = [x[bounds[i]:bounds[i + 1]].clone().requires_grad_(True) for i in range(g)]
    ys = [None] * g

    def member_step(i):
        ys[i] = members[i](xs[i])
        ys[i].backward(dy[bounds[i]:bounds[i + 1]])
    _run(member_step, g)

    torch.testing.assert_close(torch.cat(ys).detach(), _forward_of(ref, x, members[0]),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([t.grad for t in xs]), xr.grad, rtol=1e-10, atol=1e-12)
    if affine:  # each member's partial sums add up to the whole micro-batch's gradients
        torch.testing.assert_close(sum(m.weight.grad for m in members), ref.weight.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(sum(m.bias.grad for m in members), ref.bias.grad, rtol=1e-10, atol=1e-12)
    for m in members:  # running statistics advance alike everywhere, as the whole batch moves them
        torch.testing.assert_close(m.running_mean, ref.running_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m.running_var, ref.running_var, rtol=1e-12, atol=1e-12)


def _forward_of(ref, x, member):
    """BatchNorm's training-mode output on the whole batch, with `ref`'s affine parameters (no
    further change to its running statistics)."""
    return nn.functional.batch_norm(x, None, None, ref.weight, ref.bias, training=True, eps=member.eps).detach()
