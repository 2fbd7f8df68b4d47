"""Whether a BatchNorm output in training can be remade from the forward's saved statistics, bit
for bit, instead of by running the training kernel again (which recomputes the statistics).

    python bench/bn_from_saved_stats.py [--trials 5]

swarm.zoo.recompute remakes a remade layer's BatchNorm output with torch's own training kernel,
which computes the batch's mean and variance again before normalising. Its saved mean and
inverse standard deviation (the kernel's second and third outputs) would spare those passes, if
some other computation from them gave the same bits. For random maps in float32 and float64,
this compares the training kernel's output with:
  eval      the kernel in eval mode, with the saved mean as running mean and a running variance
            chosen so that 1 / sqrt(var) equals the saved inverse deviation exactly (eps 0);
  affine    x * a + b, with a = invstd * weight and b = bias - mean * a (the kernel's own terms);
  addcmul   the same through torch.addcmul (one fused multiply-add where the build makes one);
  centred   ((x - mean) * invstd) * weight + bias.
It prints, for each, in how many of the trials every element was equal.
"""
from __future__ import annotations

import argparse

import torch

SHAPES = [(4, 32, 52, 52), (3, 16, 8, 8), (2, 7, 13, 5), (5, 64, 26, 26)]


def exact_variance(invstd: torch.Tensor) -> torch.Tensor | None:
    """A variance whose 1 / sqrt is `invstd` exactly in its dtype, or None where no nearby one is."""
    var = ((1.0 / invstd.double()) ** 2).to(invstd.dtype)
    for _ in range(4):
        got = 1 / torch.sqrt(var)
        if torch.equal(got, invstd):
            return var
        up, down = torch.nextafter(var, torch.full_like(var, float("inf"))), torch.nextafter(var, torch.zeros_like(var))
        var = torch.where(got > invstd, up, torch.where(got < invstd, down, var))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="random maps per shape and dtype")
    args = parser.parse_args()
    torch.manual_seed(0)
    equal: dict[tuple[str, str], list[bool]] = {}
    for dtype in (torch.float32, torch.float64):
        for shape in SHAPES:
            for _ in range(args.trials):
                x = torch.randn(shape, dtype=dtype) * 3 + 1
                c = shape[1]
                weight, bias = torch.randn(c, dtype=dtype), torch.randn(c, dtype=dtype)
                y, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, None, None, True, 0.0, 1e-5)
                per = lambda t: t.view(1, c, *([1] * (x.dim() - 2)))  # noqa: E731
                a = invstd * weight
                var = exact_variance(invstd)
                remade = {
                    "eval": None if var is None else
                    torch.ops.aten.native_batch_norm(x, weight, bias, mean, var, False, 0.0, 0.0)[0],
                    "affine": x * per(a) + per(bias - mean * a),
                    "addcmul": torch.addcmul(per(bias - mean * a), x, per(a)),
                    "centred": ((x - per(mean)) * per(invstd)) * per(weight) + per(bias),
                }
                for way, z in remade.items():
                    equal.setdefault((str(dtype).replace("torch.", ""), way), []).append(
                        z is not None and torch.equal(y, z))
    for (dtype, way), results in equal.items():
        print(f"{dtype:8s} {way:8s} equal in {sum(results)} of {len(results)}")


if __name__ == "__main__":
    main()
