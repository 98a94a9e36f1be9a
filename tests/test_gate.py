"""Gate math (sage_core/gate.py) against simulated Bernoulli groups: fixed numpy seeds, hypothesis where it fits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_core import gate

rewards_lists = st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=64)


@pytest.mark.parametrize("G", [2, 4, 8, 16])
def test_empirical_gate_open_frequency_matches_u_within_binomial_tolerance(G):
    rng = np.random.default_rng(1000 + G)
    n = 20_000
    for p in (0.01, 0.05, 0.2, 0.5, 0.8, 0.97):
        groups = rng.random((n, G)) < p
        k = groups.sum(1)
        open_freq = float(np.mean((k > 0) & (k < G)))
        u = gate.gate_open_probability(p, G)
        tol = 4.5 * math.sqrt(u * (1 - u) / n) + 1e-12
        assert abs(open_freq - u) <= tol, (G, p, open_freq, u)
        # the per-group predicate agrees with the vectorised count (and u stays a probability for tiny p,
        # where (1-p)^G rounds to 1: about G p)
        assert gate.gate_open_probability(1e-17, G) == pytest.approx(G * 1e-17, rel=1e-6)
        for row in groups[:50]:
            assert gate.collapsed(row.astype(float).tolist()) == (row.all() or not row.any())


@given(st.integers(2, 64), st.floats(0.0, 1.0))
def test_u_is_a_probability_symmetric_and_peaks_at_one_half(G, p):
    u = gate.gate_open_probability(p, G)
    assert -1e-12 <= u <= gate.gate_open_probability(0.5, G) + 1e-12
    assert u == pytest.approx(gate.gate_open_probability(1 - p, G), abs=1e-12)


@pytest.mark.parametrize("G", [2, 4, 8, 16, 64])
def test_u_peaks_at_one_half_on_a_grid(G):
    ps = np.linspace(0, 1, 2001)
    u = gate.gate_open_probability(ps, G)
    assert u[1000] >= u.max() - 1e-15  # the max is at p = 1/2 (for large G u is flat ~1 around it)
    assert np.all(np.diff(u[:1001]) >= -1e-15) and np.allclose(u, u[::-1], atol=1e-12)  # rises, then mirrors
    if G <= 16:
        assert ps[int(np.argmax(u))] == pytest.approx(0.5, abs=1e-9)
    assert u[0] == 0 and u[-1] == 0 and u[1000] == pytest.approx(1 - 2 * 0.5**G)


@given(st.integers(2, 64), st.floats(1e-6, 1e-2))
def test_u_is_about_G_p_for_small_p(G, p):
    # 1-(1-p)^G - p^G = G p - C(G,2) p^2 + ...: between G p - C(G,2) p^2 - p^G and G p
    u = gate.gate_open_probability(p, G)
    assert G * p - math.comb(G, 2) * p**2 - p**G - 1e-15 <= u <= G * p + 1e-15
    if G * p < 0.01:
        assert u / (G * p) == pytest.approx(1.0, abs=0.01)


@settings(max_examples=200)
@given(rewards_lists)
def test_advantages_zero_mean_energy_in_unit_interval(rewards):
    a = gate.advantages(rewards)
    assert abs(float(a.sum())) < 1e-9
    e = gate.advantage_energy(rewards)
    assert 0.0 <= e <= 1.0
    assert e == pytest.approx(float(np.mean(a**2)), rel=1e-9, abs=1e-12)  # E = mean A_i^2
    if gate.collapsed(rewards):
        assert e == 0.0 and np.all(a == 0) and gate.group_state(rewards) in ("all0", "all1")
    else:
        # mixed: std >= sqrt((G-1))/G, so E >= (s/(s+eps))^2 is within a few eps/s of 1
        s_min = math.sqrt(len(rewards) - 1) / len(rewards)
        assert e >= (s_min / (s_min + gate.EPS)) ** 2 - 1e-12 and e > 0.99
        assert gate.group_state(rewards) == "mixed"


def test_simulated_energy_tracks_u():
    """Mean advantage energy over many Bernoulli groups ~ u(p) (E is ~1 on open gates, 0 on closed)."""
    rng = np.random.default_rng(5)
    G, n = 8, 4000
    for p in (0.05, 0.3, 0.5, 0.9):
        groups = (rng.random((n, G)) < p).astype(float)
        e = np.mean([gate.advantage_energy(g) for g in groups])
        u = gate.gate_open_probability(p, G)
        assert abs(e - u) <= 4.5 * math.sqrt(u * (1 - u) / n) + 1e-3


@given(st.floats(0.002, 0.998))
def test_prompt_weight_is_the_derivative_of_f(p):
    h = 1e-6
    fs = {"linear": lambda x: x, "log": math.log, "arcsin-sqrt": lambda x: math.asin(math.sqrt(x))}
    for name, f in fs.items():
        fd = (f(p + h) - f(p - h)) / (2 * h)
        assert gate.prompt_weight(p, name) == pytest.approx(fd, rel=1e-4)
    assert gate.prompt_weight(p, "none") == 1.0


def test_prompt_weight_clips_and_rejects_unknown():
    assert math.isfinite(gate.prompt_weight(0.0, "log")) and gate.prompt_weight(0.0, "log") == pytest.approx(1e3)
    assert math.isfinite(gate.prompt_weight(1.0, "arcsin-sqrt"))
    with pytest.raises(ValueError):
        gate.prompt_weight(0.5, "cubic")


@given(st.integers(0, 64), st.integers(0, 64))
def test_smoothed_pass_rate_stays_inside_and_pass_rate_counts(k, extra):
    n = k + extra
    q = gate.smoothed_pass_rate(k, n)
    assert 0 < q < 1
    if n:
        assert gate.pass_rate([1.0] * k + [0.0] * extra) == pytest.approx(k / n)
    assert math.isnan(gate.pass_rate([]))


def test_a_success_is_a_reward_above_zero_wherever_it_is_counted():
    """A reward weight (TRL's reward_weights) of 0.5 makes a correct rollout's reward 0.5: the tracker's group state,
    SAGE's trigger and the curation methods' success counts must all read it as a success, or an all-correct group
    is logged as all-zero (sage/frac_all_zero) and DAPO's filter swaps every mixed group for a fresh prompt."""
    from sage_core.curation import DapoFilter, signal
    from sage_core.schedulers import SAGE

    right, wrong, mixed = [0.5] * 4, [0.0] * 4, [0.5, 0.0, 0.0, 0.5]
    assert gate.group_state(right) == "all1" and gate.pass_rate(right) == 1.0
    assert gate.group_state(wrong) == "all0" and gate.group_state(mixed) == "mixed"
    assert SAGE().next_action("x", [(0, right)]) is None and SAGE().next_action("x", [(0, wrong)]).level == 1
    assert DapoFilter().next_action("x", [(0, mixed)]) is None  # a mixed group is kept, not swapped
    assert DapoFilter().next_action("x", [(0, right)]).mode == "new_prompt"
    assert signal(mixed) > 0
