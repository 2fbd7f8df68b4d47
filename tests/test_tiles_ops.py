"""The tiles max-pool against a plain k*k reference and against torch's untiled autograd.

The executor keeps each window's selection as a uint8 code dy * kernel + dx between forward
and backward; these tests pin that code down exactly (ties, -inf padding, overlapping windows,
strided views), since a wrong code only shows up in the gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiles import ops

NEG_INF = float("-inf")


def reference_forward(xp: torch.Tensor, kernel: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Max over the k*k strided views; code of the first view (row-major) holding the max."""
    _, _, hp, wp = xp.shape
    oh, ow = (hp - kernel) // stride + 1, (wp - kernel) // stride + 1
    views = [xp[:, :, r:r + (oh - 1) * stride + 1:stride, q:q + (ow - 1) * stride + 1:stride]
             for r in range(kernel) for q in range(kernel)]
    y = views[0].clone()
    for v in views[1:]:
        torch.maximum(y, v, out=y)
    code = torch.full(y.shape, kernel * kernel - 1, dtype=torch.uint8)
    for j in range(kernel * kernel - 2, -1, -1):
        code.masked_fill_(views[j] == y, j)
    return y, code


def reference_input_grad(dy: torch.Tensor, code: torch.Tensor, kernel: int, stride: int,
                         padded_shape: tuple[int, int]) -> torch.Tensor:
    b, c, oh, ow = dy.shape
    out = dy.new_zeros((b, c, *padded_shape))
    for j in range(kernel * kernel):
        r, q = divmod(j, kernel)
        out[:, :, r:r + (oh - 1) * stride + 1:stride, q:q + (ow - 1) * stride + 1:stride].add_(
            torch.where(code == j, dy, 0.0))
    return out


def autograd_input_grad(xp: torch.Tensor, dy: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    leaf = xp.detach().clone().requires_grad_(True)
    F.max_pool2d(leaf, kernel, stride).backward(dy)
    return leaf.grad


def padded_region(dtype: torch.dtype, contiguous: bool, seed: int) -> torch.Tensor:
    """(2, 3, 11, 12) with few distinct values (many ties) and darknet's -inf padding on a
    tile's map edges (top row and left column); a crop of a larger tensor unless `contiguous`."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randint(-2, 3, (2, 3, 14, 15), generator=g).to(dtype)
    big[:, :, :1, :] = NEG_INF
    big[:, :, :, :1] = NEG_INF
    xp = big[:, :, :11, :12]
    assert not xp.is_contiguous()
    return xp.contiguous() if contiguous else xp


CASES = [(2, 1), (2, 2), (3, 2), (3, 1), (3, 3)]


def each_shape(test):
    """Every window in CASES, both float types, contiguous and cropped inputs."""
    for mark in (pytest.mark.parametrize("contiguous", [True, False]),
                 pytest.mark.parametrize("dtype", [torch.float32, torch.float64]),
                 pytest.mark.parametrize("kernel,stride", CASES)):
        test = mark(test)
    return test


@each_shape
def test_maxpool_forward_matches_reference(kernel, stride, dtype, contiguous):
    for seed in range(3):
        xp = padded_region(dtype, contiguous, seed)
        y, code = ops.maxpool_forward(xp, kernel, stride)
        y_ref, code_ref = reference_forward(xp, kernel, stride)
        assert code.dtype == torch.uint8 and code.shape == y.shape == y_ref.shape
        assert torch.equal(y, y_ref)
        assert torch.equal(y, F.max_pool2d(xp, kernel, stride))
        assert torch.equal(code, code_ref)
        assert bool((code > 0).any()) and bool((code == 0).any())  # not every window picks one position


@each_shape
def test_maxpool_input_grad_matches_reference_and_autograd(kernel, stride, dtype, contiguous):
    for seed in range(3):
        xp = padded_region(dtype, contiguous, seed)
        _, code = ops.maxpool_forward(xp, kernel, stride)
        g = torch.Generator().manual_seed(100 + seed)
        dy_big = torch.randn((*code.shape[:2], code.shape[2] + 1, code.shape[3] + 2), generator=g, dtype=dtype)
        dy = dy_big[:, :, 1:, 2:] if not contiguous else dy_big[:, :, 1:, 2:].contiguous()
        shape = tuple(xp.shape[2:])
        dx = ops.maxpool_input_grad(dy, code, kernel, stride, shape)
        assert dx.shape == xp.shape and dx.dtype == dtype
        assert torch.equal(dx, autograd_input_grad(xp, dy, kernel, stride))
        atol = 1e-12 if dtype == torch.float64 else 1e-5  # overlapping windows may add in another order
        torch.testing.assert_close(dx, reference_input_grad(dy, code, kernel, stride, shape), rtol=0, atol=atol)
        assert float(dx[:, :, :1, :].abs().sum()) == 0.0 and float(dx[:, :, :, :1].abs().sum()) == 0.0  # padding


@pytest.mark.parametrize("kernel,stride", CASES)
def test_maxpool_input_grad_of_a_cropped_selection(kernel, stride):
    """The executor's backward reads a crop of the kept selection: a strided uint8 view."""
    xp = padded_region(torch.float64, True, 7)
    _, code = ops.maxpool_forward(xp, kernel, stride)
    sub = code[:, :, 1:, 1:]
    xs = xp[:, :, stride:, stride:]
    xs = xs[:, :, :(sub.shape[2] - 1) * stride + kernel, :(sub.shape[3] - 1) * stride + kernel]
    dy = torch.randn(sub.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    dx = ops.maxpool_input_grad(dy, sub, kernel, stride, tuple(xs.shape[2:]))
    torch.testing.assert_close(dx, reference_input_grad(dy, sub, kernel, stride, tuple(xs.shape[2:])),
                               rtol=0, atol=1e-12)
    assert torch.equal(dx, autograd_input_grad(xs, dy, kernel, stride))


def test_a_window_of_only_minus_inf_selects_its_first_position_as_torch_does():
    xp = torch.full((1, 1, 4, 4), NEG_INF, dtype=torch.float64)
    xp[0, 0, 3, 3] = 1.0
    y, code = ops.maxpool_forward(xp, 2, 2)
    assert torch.equal(code, torch.tensor([[[[0, 0], [0, 3]]]], dtype=torch.uint8))
    assert y[0, 0, 1, 1] == 1.0 and bool(y[0, 0].flatten()[:3].isneginf().all())
    dy = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=torch.float64)
    dx = ops.maxpool_input_grad(dy, code, 2, 2, (4, 4))
    assert torch.equal(dx, autograd_input_grad(xp, dy, 2, 2))
    assert dx[0, 0, 0, 0] == 1.0 and dx[0, 0, 0, 2] == 2.0 and dx[0, 0, 2, 0] == 3.0 and dx[0, 0, 3, 3] == 4.0


def test_nan_is_selected_as_torch_selects_it():
    xp = torch.tensor([[[[1.0, 3.0, 3.0], [3.0, 0.0, float("nan")], [float("nan"), 2.0, 1.0]]]])
    y, code = ops.maxpool_forward(xp, 2, 1)
    assert torch.allclose(y, F.max_pool2d(xp, 2, 1), equal_nan=True)
    assert torch.equal(code, torch.tensor([[[[1, 3], [2, 1]]]], dtype=torch.uint8))
    dy = torch.tensor([[[[1.0, 2.0], [4.0, 8.0]]]])
    assert torch.equal(ops.maxpool_input_grad(dy, code, 2, 1, (3, 3)), autograd_input_grad(xp, dy, 2, 1))


def test_a_map_with_unread_last_rows_and_columns():
    """A stride that skips the region's last row and column: they get no gradient."""
    xp = torch.randn(2, 2, 9, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y, code = ops.maxpool_forward(xp, 2, 2)
    assert y.shape == (2, 2, 4, 3)
    assert torch.equal(code, reference_forward(xp, 2, 2)[1])
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    dx = ops.maxpool_input_grad(dy, code, 2, 2, (9, 7))
    assert torch.equal(dx, autograd_input_grad(xp, dy, 2, 2))
    assert float(dx[:, :, 8, :].abs().sum()) == 0.0 and float(dx[:, :, :, 6].abs().sum()) == 0.0
