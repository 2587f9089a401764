"""Non-negative least squares on relative error, with terms tied to or fixed beside the
fitted ones: the solver the device fit (linkctl.estimate.devicefit) and calibration
(linkctl.calibrate.solve) share.

A sample is (features, measured µs); the fit minimises sum over samples of
(coefs . features / measured - 1)^2 over coefs >= 0.
"""

from __future__ import annotations

import itertools

Sample = tuple[list[float], float]  # (features, measured µs)
Ties = dict[int, tuple[int, float]]  # {tied term: (the term it follows, ratio)}


def nnls(a: list[list[float]], b: list[float]) -> tuple[list[float], float]:
    """min |A x - b|^2 over x >= 0, exactly, by trying every support set (<= 6 columns)."""
    import numpy as np

    A, B = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = A.shape[1]
    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)
    As = A / scale
    best, best_x = float("inf"), np.zeros(n)
    for k in range(1, n + 1):
        for sup in itertools.combinations(range(n), k):
            cols = list(sup)
            x, *_ = np.linalg.lstsq(As[:, cols], B, rcond=None)
            if (x < 0).any():
                continue
            full = np.zeros(n)
            full[cols] = x
            r = float(((As @ full - B) ** 2).sum())
            if r < best - 1e-15:
                best, best_x = r, full
    return [float(v) for v in best_x / scale], best


def _free(n_coef: int, ties: Ties, fixed: dict[int, float]) -> list[int]:
    return [i for i in range(n_coef) if i not in ties and i not in fixed]


def _design(samples: list[Sample], free: list[int], ties: Ties) -> list[list[float]]:
    """One row per sample, one column per free term (with the terms tied to it), over
    the measured time: relative error."""
    return [
        [(f[i] + sum(k * f[j] for j, (p, k) in ties.items() if p == i)) / t for i in free]
        for f, t in samples
    ]


def solve_tied(
    samples: list[Sample], n_coef: int, ties: Ties, fixed: dict[int, float]
) -> list[float]:
    """Fit the free coefficients; a tied one is ratio x its partner, a fixed one is given."""
    free = _free(n_coef, ties, fixed)
    a = _design(samples, free, ties)
    b = [1.0 - sum(fixed[i] * f[i] for i in fixed) / t for f, t in samples]
    x, _ = nnls(a, b) if free else ([], 0.0)
    c = [0.0] * n_coef
    for i, v in fixed.items():
        c[i] = v
    for i, v in zip(free, x, strict=True):
        c[i] = v
    for j, (p, k) in ties.items():
        c[j] = k * c[p]
    return c


def full_rank(samples: list[Sample], n_coef: int, ties: Ties, fixed: dict[int, float]) -> bool:
    """Whether the samples separate every free term (no two free columns collinear, e.g. a
    per-block cost and a bandwidth when every row is the same model shape)."""
    import numpy as np

    free = _free(n_coef, ties, fixed)
    if not free:
        return True
    A = np.asarray(_design(samples, free, ties), dtype=float)
    scale = np.abs(A).max(axis=0)
    A = A / np.where(scale > 0, scale, 1.0)
    # Near-collinear counts as collinear: an F16 row's few quantized FLOPS (its
    # quantized output head) must not be what "separates" a per-micro-batch cost.
    sv = np.linalg.svd(A, compute_uv=False)
    return bool(len(sv) == len(free) and sv.min() > 1e-3 * sv.max())
