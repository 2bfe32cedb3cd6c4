"""How far apart two trainers' weights may end after the same AdamW steps, when their gradients
differ only by float32 rounding (another backend, other micro-batches, another CPU's kernels).

Why not a fixed tolerance on the weights: AdamW steps each element by lr * m^ / (s^ + eps), the
gradient's running mean over its running root mean square (bias-corrected). Where an element's
gradient is near its own rounding, that ratio is rounding too, and the element moves anywhere in
[-lr, lr] on either side. The weights' largest difference says how small the smallest gradients
happened to be on that machine, not whether the two trainers agree: a bound of 1e-4 passed on an
Intel Xeon and failed by 12% on an AMD EPYC (AVX2 kernels) with the same code.

So each part is compared where it is well conditioned:

- The first optimizer step's gradients, which both trainers take from the same weights: the same
  sums in another order. They differ by at most gamma_N times the terms, N the minibatch's
  positions; the tensor's largest gradient is taken as the terms' scale:
  |g - g'| <= N * u32 * max|g| per tensor (`first_step_bound`, `gradient_excess`). This bound
  depends on no machine's kernels.
- The weights after every step, element by element, against what AdamW can make of the two
  runs' moments (`adam_tolerance`). After the first step the weights differ, so the later
  gradients differ by more than rounding (the first step's difference, through the model). That
  part has no a priori bound; it is measured (`moments_apart`: both runs' gradients as their
  optimizers took them, clipped; or `saved_moments_apart`: their saved AdamW state), and the
  steps' loss and gradient-norm metrics are what say the trainers compute the same thing there.

The bound. m^_t = sum_s w1_s g_s and s^_t^2 = sum_s w2_s g_s^2, with positive weights summing to
1, so |m^_t| <= R_t s^_t by Cauchy-Schwarz, R_t = sqrt(sum_s w1_s^2 / w2_s) (1 at the first
step, 1.0014 at the second, under 7.3 at any). With dm = |m^ - m^'| and ds = |s^ - s^'|, exactly,

    |u - u'| = |(m^' - m^)(s^ + eps) - m^'(s^' - s^)| / ((s^ + eps)(s^' + eps)) <= (dm + R_t ds) / (s^ + eps),

with s^ the reference's own, and |u|, |u'| <= R_t: step t moves the two apart by at most
lr * min(2 R_t, (dm + R_t ds) / (s^ + eps)). Where every gradient so far differs by at most D,
dm <= D and ds <= D (a weighted root mean square moves no more than its inputs). Decoupled weight
decay multiplies a difference by 1 - lr * wd <= 1; a step-KL halving or undo (`trainers.step_kl`)
scales both runs' step alike. Each side's fp32 arithmetic adds at most a few units of roundoff of
the update and of the weight per step and per halving: `roundings` x 2 u32 (|w| + 8 lr R).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

U32 = 2.0**-24  # float32's unit roundoff
BETAS = (0.9, 0.999)  # torch AdamW's defaults, which both trainers use
EPS = 1e-8

Gradients = dict[str, torch.Tensor]
# Per tensor: bounds on |m^ - m^'| and |s^ - s^'| at one step (tensors, or one number for all elements).
Apart = dict[str, tuple[torch.Tensor | float, torch.Tensor | float]]


def record_gradients(optimizer: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> list[Gradients]:
    """The gradients `optimizer` steps with, one dict per `step()` (float64 copies on the CPU, by name)."""
    params = list(named)
    steps: list[Gradients] = []

    def keep(*_: object) -> None:
        steps.append({n: p.grad.detach().double().cpu() for n, p in params if p.grad is not None})

    optimizer.register_step_pre_hook(keep)
    return steps


def ratio_bound(t: int, betas: tuple[float, float] = BETAS) -> float:
    """R_t: the most |m^| / s^ can be at AdamW's step t (module docstring)."""
    b1, b2 = betas
    w1 = [(1 - b1) * b1 ** (t - s) / (1 - b1**t) for s in range(1, t + 1)]
    w2 = [(1 - b2) * b2 ** (t - s) / (1 - b2**t) for s in range(1, t + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(w1, w2, strict=True)))


def first_step_bound(ref: Gradients, *, positions: int) -> dict[str, float]:
    """Per tensor, the most the first step's gradients may differ: N u32 max|g| (module docstring)."""
    return {name: positions * U32 * float(g.abs().max()) for name, g in ref.items()}


def gradient_excess(
    ref: Gradients,
    other: Gradients,
    *,
    positions: int,
    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """The first step's largest gradient difference over `first_step_bound` (<= 1 passes).
    `shard(name, full)`: the part of the reference's tensor that `other` holds (a TP rank's)."""
    bound = first_step_bound(ref, positions=positions)
    worst = 0.0
    for name, g in other.items():
        full = ref[name] if shard is None else shard(name, ref[name])
        d = float((full - g).abs().max())
        worst = max(worst, d / bound[name] if bound[name] > 0 else (0.0 if d == 0 else math.inf))
    return worst


def moments_apart(
    ref: Sequence[Gradients], other: Sequence[Gradients], betas: tuple[float, float] = BETAS
) -> list[Apart]:
    """Per step, |m^ - m^'| and |s^ - s^'| element by element, from both runs' gradients."""
    if len(ref) != len(other):
        raise AssertionError(f"the reference took {len(ref)} optimizer steps, the other {len(other)}")
    b1, b2 = betas
    state: dict[str, list[torch.Tensor]] = {}
    out: list[Apart] = []
    for t, (a, b) in enumerate(zip(ref, other, strict=True), start=1):
        step: Apart = {}
        for name in a.keys() & b.keys():
            ma, va, mb, vb = state.setdefault(name, [torch.zeros_like(a[name]) for _ in range(4)])
            ma.mul_(b1).add_(a[name], alpha=1 - b1)
            mb.mul_(b1).add_(b[name], alpha=1 - b1)
            va.mul_(b2).add_(a[name].pow(2), alpha=1 - b2)
            vb.mul_(b2).add_(b[name].pow(2), alpha=1 - b2)
            step[name] = ((ma - mb).abs() / (1 - b1**t), ((va / (1 - b2**t)).sqrt() - (vb / (1 - b2**t)).sqrt()).abs())
        out.append(step)
    return out


def saved_moments_apart(
    a: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    b: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    step: int,
    betas: tuple[float, float] = BETAS,
) -> Apart:
    """|m^ - m^'| and |s^ - s^'| at `step`, from both runs' saved AdamW state (exp_avg, exp_avg_sq)."""
    b1, b2 = betas
    out: Apart = {}
    for name, (ma, va) in a.items():
        mb, vb = b[name]
        s_a, s_b = (va.double() / (1 - b2**step)).sqrt(), (vb.double() / (1 - b2**step)).sqrt()
        out[name] = ((ma.double() - mb.double()).abs() / (1 - b1**step), (s_a - s_b).abs())
    return out


def adam_tolerance(
    ref: Sequence[Gradients],
    apart: Sequence[Apart],
    weights: Mapping[str, torch.Tensor],
    *,
    lr: float,
    roundings: int | None = None,
    betas: tuple[float, float] = BETAS,
    eps: float = EPS,
) -> dict[str, torch.Tensor]:
    """Each weight's bound on |w - w'| after the steps whose reference gradients are `ref` and whose
    moments lie `apart` (module docstring). `weights`: the reference's final weights, by the same
    names; `roundings`: the optimizer steps plus any step-KL halvings."""
    b2 = betas[1]
    steps = len(ref)
    r_max = max((ratio_bound(t, betas) for t in range(1, steps + 1)), default=1.0)
    tolerance = {}
    for name, w in weights.items():
        v = torch.zeros_like(w, dtype=torch.float64)
        total = torch.zeros_like(v)
        for t, (g, step) in enumerate(zip(ref, apart, strict=True), start=1):
            if name in g:  # none: AdamW skipped it; counting the step anyway only widens the bound
                v = b2 * v + (1 - b2) * g[name].pow(2)
            dm, ds = step.get(name, (0.0, 0.0))
            r = ratio_bound(t, betas)
            total += lr * torch.clamp((dm + r * ds) / ((v / (1 - b2**t)).sqrt() + eps), max=2 * r)
        count = steps if roundings is None else roundings
        tolerance[name] = total + count * 2 * U32 * (w.double().abs() + 8 * lr * r_max)
    return tolerance


def weight_excess(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], tolerance: Mapping[str, torch.Tensor]
) -> float:
    """The largest |a - b| over its tolerance, element by element (<= 1 passes)."""
    return max(float(((a[k].double() - b[k].double()).abs() / tolerance[k]).max()) for k in tolerance)
