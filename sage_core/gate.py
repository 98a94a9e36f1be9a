"""The GRPO gate. A group of G rollouts of one prompt with 0/1 rewards R_1..R_G gets advantages
A_i = (R_i - mean R) / (std R + eps). If every R_i is equal the std is 0, every A_i is 0 and the prompt teaches
nothing: the gate is closed. With pass rate p the gate is open with probability u(p) = 1 - (1-p)^G - p^G.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS = 1e-4  # TRL's advantage epsilon


def collapsed(rewards: Sequence[float], tol: float = 1e-6) -> bool:
    """A group is collapsed when all its rewards are equal (max - min <= tol)."""
    return (max(rewards) - min(rewards)) <= tol


def group_state(rewards: Sequence[float], tol: float = 1e-6) -> str:
    """'all0' (every rollout failed), 'all1' (every rollout succeeded), 'mixed' (the gate is open). A success is a
    reward > 0, as pass_rate and SAGE's trigger count it (a reward weight of 0.5 makes a correct rollout's 0.5)."""
    if not collapsed(rewards, tol):
        return "mixed"
    return "all1" if rewards[0] > 0 else "all0"


def pass_rate(rewards: Sequence[float]) -> float:
    """p^ = fraction of rollouts with reward > 0."""
    return float(np.mean(np.asarray(rewards, dtype=float) > 0)) if len(rewards) else float("nan")


def advantages(rewards: Sequence[float], eps: float = EPS) -> np.ndarray:
    """A_i = (R_i - mean R) / (std R + eps), std with 1/G (the paper's Eq. 2)."""
    r = np.asarray(rewards, dtype=float)
    return (r - r.mean()) / (r.std() + eps)


def advantage_energy(rewards: Sequence[float], eps: float = EPS) -> float:
    """E = s^2 / (s + eps)^2 = mean A_i^2: ~1 when the gate is open, 0 when it is closed."""
    s = float(np.asarray(rewards, dtype=float).std())
    return s * s / (s + eps) ** 2


def gate_open_probability(p: float | np.ndarray, G: int) -> float | np.ndarray:
    """u(p) = 1 - (1-p)^G - p^G: the chance that G Bernoulli(p) rollouts are not all equal."""
    p = np.asarray(p, dtype=float)
    # 1 - (1-p)^G as -expm1(G log1p(-p)): exact for tiny p, where (1-p)^G rounds to 1 (and u went negative)
    with np.errstate(divide="ignore"):  # p = 1: log1p(-1) = -inf, expm1(-inf) = -1
        u = -np.expm1(G * np.log1p(-p)) - p**G
    u = np.clip(u, 0.0, 1.0)
    return float(u) if u.ndim == 0 else u


def prompt_weight(p: float | np.ndarray, f: str, clip: float = 1e-3) -> float | np.ndarray:
    """w(p) = f'(p) for the objective f(p) a prompt's pass rate is pushed up by.

    linear: f = p            -> w = 1
    log:    f = log p        -> w = 1/p
    arcsin-sqrt: f = arcsin(sqrt p) -> w = 1 / (2 sqrt(p (1-p)))
    p is clipped to [clip, 1-clip] so the weight stays finite.
    """
    p = np.clip(np.asarray(p, dtype=float), clip, 1.0 - clip)
    if f in ("none", "linear"):
        w = np.ones_like(p)
    elif f == "log":
        w = 1.0 / p
    elif f == "arcsin-sqrt":
        w = 1.0 / (2.0 * np.sqrt(p * (1.0 - p)))
    else:
        raise ValueError(f"unknown prompt objective f={f!r}; choose linear, log or arcsin-sqrt")
    return float(w) if w.ndim == 0 else w


def smoothed_pass_rate(successes: int, n: int, alpha: float = 1.0, beta: float = 1.0) -> float:
    """Posterior mean of p under a Beta(alpha, beta) prior: keeps p~ away from 0 and 1."""
    return (successes + alpha) / (n + alpha + beta)

