r"""Curation methods beside hints (issue 6): DAPO dynamic sampling, Reinforce-Ada (Seq and Est), prompt weighting.

All are `Scheduler`s driven by the trainer's contract (see `schedulers.py`): first try of G rollouts at
`level_before`, then `next_action` until None, then `finalize` -> `Selection(picks, weight)`; the trainer multiplies
the group's TRL advantages by `weight`.

  dapo-filter          a collapsed group is swapped for a fresh prompt (`Action(0, 'new_prompt')`) until a mixed
                       group or `max_rounds` tries; the trained group is the last try.
  ada-seq              Reinforce-Ada-Seq: 'extend' rounds at the same level until the pool holds >= min_pos
                       positives and >= min_neg negatives, or `max_rounds` tries; a balanced G-subset is trained.
  ada-est              Reinforce-Ada-Est: the first try is a pilot; the prompt then gets n(k1) rounds in total,
                       n ~ c / p^ (clipped to [1, max_rounds], c fitted so the mean is `avg_rounds`), no stopping.
  sage-light+ada-seq   SAGE-LIGHT's tracked hint level, ada-seq sampling at that level.
  weighting f          `with_weighting(scheduler, f)`: any method trains objective f (linear, log, sqrt,
                       arcsin-sqrt) through `Selection.weight`.
`max_rounds` counts tries per prompt per step, the first one included: the per-prompt budget is B = max_rounds * G.

What the weight corrects, exactly
---------------------------------
One prompt, policy pi, reward R(y) in {0,1}, pass rate p = P(R=1). Let g+ = E[grad log pi(y) | R=1],
g- = E[grad log pi(y) | R=0]. Since E[grad log pi] = 0 and grad p = E[R grad log pi]:
p g+ + (1-p) g- = 0 and grad p = p g+, so g+ - g- = grad p / (p(1-p)).

A method trains a group (picks) with TRL advantages A_i (mean-centred over the G picked rewards, so sum A_i = 0;
divided by the Bessel std + 1e-4 when scale_rewards='group') multiplied by w; the policy-gradient term of the update
(on-policy, before clipping and token averaging) is U = w sum_i A_i grad log pi(y_i). Every decision (stop, extend,
which rows, w) depends on rewards only, so given the rewards the y_i are independent draws of pi(.|R_i) and

    E[U] = E[w sum_i A_i (R_i g+ + (1-R_i) g-)] = E[w S] (g+ - g-) = E[w S] / (p(1-p)) * grad p,
    S := sum_i A_i 1[R_i = 1].

So the objective a method climbs on this prompt has slope W(p) = E[w S] / (p(1-p)), and objective f needs
E[w S] proportional to T_f(p) := f'(p) p (1-p). We normalise T_f(1/2) = 1:

    linear       f = p               T = 4 p (1-p)
    log          f = log p           T = 2 (1-p)
    sqrt         f = 2 sqrt p        T = 2 sqrt(2) sqrt(p) (1-p)     (the issue's "1/sqrt(p~)" weight)
    arcsin-sqrt  f = arcsin sqrt p   T = 2 sqrt(p (1-p))

Plain GRPO (one group, w=1): S = c_G sqrt(q(1-q)) with q = k/G, so E[S] is the degree-G Bernstein polynomial of
sqrt(p(1-p)): approximately arcsin-sqrt. A balanced downsample WITHOUT correction (w=1): A_i = +-1 (about), so
S = S_ref (the S of a half/half group) whenever the pool is mixed and E[S] = S_ref u_B(p) with
u_B(p) = 1-(1-p)^B-p^B: slope u_B(p)/(p(1-p)), the logit objective seen through the budget's gate, NOT log p:
against log p it over-weights a p=0.8 prompt 4x relative to a p=0.2 prompt (factor 1/(1-p)).

The correction: w = h * S_ref / S_sel, where S_sel is the S of the selected group (computed with TRL's formula, so
the way rows are picked cannot bias anything: with repeats, unbalanced or balanced picks, only h remains) and h is an
estimate of T_f(p) made from the pilot, the first try of G rollouts, k1 successes (`estimator='pilot'`):

    linear  h(k) = 4 k (G-k) / (G (G-1))      log  h(k) = 2 (G-k) / G        (unbiased: E h(k1) = T_f(p))

and then E[w S] = S_ref E[h(k1) 1{pool mixed}], and the pool ends mixed exactly when the rollouts the method
would spend on the prompt are not all equal (ada-seq stops early only once mixed; ada-est's allocation depends on
k1 only). Hence, EXACTLY, for every p and G:

    E[w S] = S_ref * ( T_f(p) - h(0) (1-p)^{n0} - h(G) p^{nG} )                                         (*)

where n0 (nG) is the number of rollouts the method spends on a prompt whose pilot is all-0 (all-1) and which never
turns mixed (ada-seq: B on an extended side, G otherwise; ada-est: n(0)*G, n(G)*G; grpo: G). So:
  - linear: h(0) = h(G) = 0: exactly unbiased for any budget (but then re-sampling a collapsed pilot buys nothing);
  - log: slope W(p) = (2/p) S_ref (1 - (1-p)^{n0-1}): grad log p, attenuated only by the chance that the rest of
    the budget holds no success; re-sampling all-1 pilots buys nothing (h(G) = 0), so extend='auto' re-samples
    only the collapsed side whose h is > 0.
  - sqrt, arcsin-sqrt: T_f is not a polynomial, so no unbiased h exists (E h(k1) is a degree-G polynomial);
    h(k) = T_f(p^) with Jeffreys smoothing p^ = (k + 1/2)/(G + 1) (never 0 or 1); (*) still holds with
    sum_k Binom(k; G, p) h(k) in place of T_f(p), which is how the tests check it.
`estimator='pool'` is Reinforce-Ada's plug-in p~ = positives / pool size (Beta(1,1)-smoothed): it uses every
rollout, but sequential stopping biases it (the pool stops right after the first minority rollout, inflating the
minority frequency: for log with G=8 and 4 rounds, E[w S] is 15%, 34%, 83% above T_f at p = 0.7, 0.8, 0.9).
`expected_signal` computes (*); `exact_signal` computes E[w S] of a scheduler by enumerating every reward-count
history through the real code.

Why not "w = 1/p~" for log: that is f'(p), the weight on grad p when advantages are r - p~ (Reinforce-Ada's pool
baseline, no std). TRL divides a balanced group by its std, which already supplies 1/(p(1-p)) (slope above), so
the explicit weight that leaves f'(p) = 1/p is T_log = 2(1-p) / S_sel-normalised; 'sqrt' (f' = 1/sqrt p) is the
issue's "1/sqrt(p~)" variant (objective='sqrt'; RunSpec.weighting does not list it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Literal

import numpy as np

from .gate import prompt_weight, smoothed_pass_rate
from .schedulers import SCHEDULERS, Action, SAGELight, Scheduler, Selection, Tries

OBJECTIVES = ("linear", "log", "sqrt", "arcsin-sqrt")
TRL_EPS = 1e-4


# ---------------------------------------------------------------------------------------------- the math
def target_weight(p: float | np.ndarray, objective: str) -> float | np.ndarray:
    """T_f(p) = f'(p) p (1-p), normalised to 1 at p = 1/2 (the E[w S] / S_ref objective f asks for)."""
    p = np.asarray(p, dtype=float)
    if objective == "none":
        t = np.ones_like(p)
    elif objective == "sqrt":
        t = 2.0 * math.sqrt(2.0) * np.sqrt(p) * (1.0 - p)
    elif objective in ("linear", "log", "arcsin-sqrt"):
        # gate.prompt_weight is f'(p) (clipped); f'(1/2) is 1, 2, 1 for linear, log, arcsin-sqrt
        pc = np.clip(p, 1e-12, 1.0 - 1e-12)  # f'(p) is clipped there: so is the p it is multiplied by (log: 2(1-p))
        t = prompt_weight(pc, objective, clip=1e-12) * pc * (1.0 - pc) * 4.0 / prompt_weight(0.5, objective)
    else:
        raise ValueError(f"unknown objective {objective!r}; choose one of {OBJECTIVES} (or 'none')")
    return float(t) if t.ndim == 0 else t


def pilot_weight(k: int, G: int, objective: str) -> float:
    """h(k): estimate of T_f(p) from the pilot's k successes out of G (unbiased for linear and log)."""
    if objective == "none":
        return 1.0
    if objective == "linear":
        return 4.0 * k * (G - k) / (G * (G - 1))
    if objective == "log":
        return 2.0 * (G - k) / G
    return float(target_weight((k + 0.5) / (G + 1.0), objective))


def pool_weight(k: int, n: int, objective: str) -> float:
    """Reinforce-Ada's plug-in T_f(p~), p~ = (k+1)/(n+2) over the whole pool (biased by sequential stopping)."""
    return 1.0 if objective == "none" else float(target_weight(smoothed_pass_rate(k, n), objective))


def trl_advantages(rewards: Sequence[float], scale_rewards: str = "group", eps: float = TRL_EPS) -> np.ndarray:
    """TRL's group advantages: r - mean, divided by the Bessel std + eps unless scale_rewards == 'none'
    ('batch' divides by a batch-wide constant: treated as 'none', the constant does not change proportions)."""
    r = np.asarray(rewards, dtype=float)
    a = r - r.mean()
    if scale_rewards == "group":
        a = a / ((r.std(ddof=1) if len(r) > 1 else 0.0) + eps)
    return a


def signal(rewards: Sequence[float], scale_rewards: str = "group") -> float:
    """S = sum_i A_i 1[R_i = 1]: the group's push on grad p is S / (p(1-p)) (see the module docstring)."""
    r = np.asarray(rewards, dtype=float)
    return float((trl_advantages(r, scale_rewards) * (r > 0)).sum())


def balanced_rewards(G: int) -> list[float]:
    """The rewards of a half/half group (the extra row of an odd G is a positive)."""
    return [1.0] * (G - G // 2) + [0.0] * (G // 2)


def reference_signal(G: int, scale_rewards: str = "group") -> float:
    """S_ref: S of a half/half group of G."""
    return signal(balanced_rewards(G), scale_rewards)


def expected_signal(p: float, G: int, objective: str, n0: int, nG: int, scale_rewards: str = "group") -> float:
    """E[w S] of a pilot-weighted method, by (*) in the module docstring: S_ref (E h(k1) - h(0)(1-p)^n0 -
    h(G) p^nG), with n0 / nG the rollouts spent on a prompt whose pilot is all-0 / all-1 and that stays collapsed."""
    ks = np.arange(G + 1)
    binom = np.array([math.comb(G, int(k)) for k in ks]) * p**ks * (1 - p) ** (G - ks)
    h = np.array([pilot_weight(int(k), G, objective) for k in ks])
    return reference_signal(G, scale_rewards) * float(binom @ h - h[0] * (1 - p) ** n0 - h[G] * p**nG)


def exact_signal(make, p: float, G: int, level: int = 0, scale_rewards: str = "group") -> dict:
    """E[w S], E[rollouts] and P(mixed) of a scheduler on a Bernoulli(p) prompt, exactly: every history of reward
    counts per try is run through the real `next_action` / `finalize` (rollouts within a try are exchangeable, so a
    try with k successes is [1]*k + [0]*(G-k)) and weighted by its probability. `make()` builds a fresh scheduler.
    Not for 'new_prompt' methods (the new prompt has its own p)."""
    pmf = [math.comb(G, k) * p**k * (1 - p) ** (G - k) for k in range(G + 1)]
    out = dict(ws=0.0, rollouts=0.0, mixed=0.0)

    def walk(tries, prob):
        if prob < 1e-15:
            return
        sched = make()
        a = sched.next_action("x", tries)
        if a is None:
            sel = sched.finalize("x", tries)
            rew = [tries[t][1][j] for t, j in sel.picks]
            s = signal(rew, scale_rewards)
            out["ws"] += prob * sel.weight * s
            out["rollouts"] += prob * G * len(tries)
            out["mixed"] += prob * (s > 0)
            return
        if a.mode == "new_prompt":
            raise ValueError("exact_signal does not follow 'new_prompt' actions")
        for k in range(G + 1):
            walk(tries + [(a.level, [1.0] * k + [0.0] * (G - k))], prob * pmf[k])

    for k in range(G + 1):
        walk([(level, [1.0] * k + [0.0] * (G - k))], pmf[k])
    return out


# ---------------------------------------------------------------------------------------------- base
class _Curation(Scheduler):
    """Shared pieces: objective weighting, per-step metrics (`metrics()` returns and resets them)."""

    handles_weighting = True  # with_weighting leaves these alone: they read `weighting` themselves

    def __init__(self, max_rounds: int = 4, weighting: str = "none", objective: str | None = None,
                 num_generations: int | None = None, scale_rewards: str = "group", seed: int = 0):
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        self.max_rounds = int(max_rounds)
        self.objective = self._objective(weighting, objective)
        self.G = num_generations
        self.scale_rewards = scale_rewards
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._reset_metrics()

    default_objective = "none"

    def rng_state(self) -> dict:
        """The state of the generator `finalize` draws from (a pooled method's balanced subset). Each process
        finalizes its own groups, so each has its own; the trainer saves it beside each checkpoint and a resumed run
        takes it back (SageGRPOTrainer.restore_state), so its picks are the straight run's."""
        return self.rng.bit_generator.state

    def load_rng_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state

    def seed_process(self, rank: int) -> None:
        """A generator of process `rank`'s own (the trainer calls this as it is built, before a resume loads the
        checkpoint's state): each process finalizes its own groups, and with one seed on every process their picks
        were the same draws wherever the pools had the same sizes. Rank 0 keeps `seed`'s, so a one-process run picks
        as before; rank r > 0 draws from the seed sequence [seed, r]."""
        if rank:
            self.rng = np.random.default_rng([self.seed, rank])

    def _objective(self, weighting: str, objective: str | None) -> str:
        obj = weighting if weighting not in (None, "none") else (objective or self.default_objective)
        if obj != "none" and obj not in OBJECTIVES:
            raise ValueError(f"unknown objective {obj!r}; choose one of {OBJECTIVES} or 'none'")
        return obj

    def _reset_metrics(self) -> None:
        self._m = dict(groups=0, rollouts=0, tries=0, mixed=0, weight=0.0, p_tilde=0.0, new_prompts=0)

    def _count(self, tries: Tries, mixed: bool, weight: float, p_tilde: float, new_prompts: int = 0) -> None:
        m = self._m
        m["groups"] += 1
        m["rollouts"] += sum(len(r) for _, r in tries)
        m["tries"] += len(tries)
        m["mixed"] += int(mixed)
        m["weight"] += weight if mixed else 0.0
        m["p_tilde"] += p_tilde
        m["new_prompts"] += new_prompts

    def metric_counts(self) -> dict[str, float]:
        """This step's raw counters, then reset: the trainer sums them over processes and hands the sum to
        `metrics` (a mean of each process's ratio is not the ratio: rollouts_per_mixed, sel_weight)."""
        m = self._m
        self._reset_metrics()
        return m

    def metrics(self, counts: dict[str, float] | None = None) -> dict[str, float]:
        """This step's curation counters (the trainer logs them as sage/<key>), then reset; or those of `counts`
        (metric_counts summed over processes).
        rollouts_per_group: completions spent per prompt slot; rollouts_per_mixed: per trained mixed group (DAPO's
        'rollouts per kept group'); extra_rounds: tries beyond the first; mixed_frac: trained groups with signal;
        sel_weight: mean Selection.weight over mixed groups; p_tilde: mean pool pass-rate estimate."""
        m = self.metric_counts() if counts is None else counts
        n = m["groups"]
        if n == 0:
            return {}
        out = {
            "rollouts_per_group": m["rollouts"] / n,
            "rollouts_per_mixed": m["rollouts"] / m["mixed"] if m["mixed"] else float("nan"),
            "extra_rounds": (m["tries"] - n) / n,
            "mixed_frac": m["mixed"] / n,
            "sel_weight": m["weight"] / m["mixed"] if m["mixed"] else float("nan"),
            "p_tilde": m["p_tilde"] / n,
        }
        if isinstance(self, DapoFilter):
            out["new_prompts"] = m["new_prompts"] / n
        return out

    def _weight(self, k1: int, G: int, picked: list[float], pool_k: int, pool_n: int,
                estimator: str = "pilot") -> float:
        """w = h * S_ref / S_sel (1 for a collapsed selection: its advantages are 0 anyway)."""
        if self.objective == "none":
            return 1.0
        s_sel = signal(picked, self.scale_rewards)
        if s_sel <= 0:
            return 1.0
        h = pilot_weight(k1, G, self.objective) if estimator == "pilot" else pool_weight(pool_k, pool_n,
                                                                                         self.objective)
        return float(h * reference_signal(G, self.scale_rewards) / s_sel)


def _k(rewards: Sequence[float]) -> int:
    """Successes: rewards > 0, as gate.pass_rate and SAGE count them (a weighted reward's success may be < 1)."""
    return sum(1 for r in rewards if r > 0)


# ---------------------------------------------------------------------------------------------- dapo-filter
class DapoFilter(_Curation):
    """DAPO dynamic sampling: a collapsed group is replaced by a fresh prompt (trainer: mode 'new_prompt') until
    a mixed group or `max_rounds` tries; the last try is trained (weighted by `weighting`, if any)."""

    name = "dapo-filter"
    swaps_prompts = True  # asks for 'new_prompt': the trainer gathers the batch's prompt ids every step

    def next_action(self, pid: str, tries: Tries) -> Action | None:
        rewards = tries[-1][1]
        if len(tries) >= self.max_rounds or (rewards and _k(rewards) not in (0, len(rewards))):
            return None
        return Action(0, "new_prompt")

    def finalize(self, pid: str, tries: Tries) -> Selection:
        t = len(tries) - 1
        rewards = tries[t][1]
        G = len(rewards)
        k = _k(rewards)
        w = self._weight(k, G, rewards, k, G)
        self._count(tries, 0 < k < G, w, k / G, new_prompts=len(tries) - 1)
        return Selection([(t, j) for j in range(G)], w)


# ---------------------------------------------------------------------------------------------- pooled sampling
class _Pooled(_Curation):
    """Pool every try of the prompt, train on a balanced G-subset, weight by the objective's correction."""

    default_objective = "log"
    Extend = Literal["auto", "both", "all0", "all1"]

    def __init__(self, max_rounds: int = 4, weighting: str = "none", objective: str | None = None,
                 estimator: Literal["pilot", "pool"] = "pilot", extend: Extend = "auto",
                 num_generations: int | None = None, scale_rewards: str = "group", seed: int = 0):
        super().__init__(max_rounds, weighting, objective, num_generations, scale_rewards, seed)
        if estimator not in ("pilot", "pool"):
            raise ValueError(f"estimator must be 'pilot' or 'pool', got {estimator!r}")
        if extend not in ("auto", "both", "all0", "all1"):
            raise ValueError(f"extend must be auto, both, all0 or all1, got {extend!r}")
        self.estimator, self.extend = estimator, extend

    def _extends(self, side_all_one: bool, G: int) -> bool:
        """Whether a pool collapsed on this side is re-sampled ('auto': only where the estimator's h is > 0)."""
        if self.extend == "both":
            return True
        if self.extend in ("all0", "all1"):
            return side_all_one == (self.extend == "all1")
        if self.estimator == "pool" or self.objective == "none":
            return True
        return pilot_weight(G if side_all_one else 0, G, self.objective) > 0

    def finalize(self, pid: str, tries: Tries) -> Selection:
        level = tries[0][0]
        rows = [(t, j, r) for t, (lvl, rs) in enumerate(tries) if lvl == level for j, r in enumerate(rs)]
        G = len(tries[0][1])
        pos = [(t, j) for t, j, r in rows if r > 0]
        neg = [(t, j) for t, j, r in rows if r <= 0]
        k1 = _k(tries[0][1])
        if not pos or not neg:  # collapsed pool: the pilot, no signal
            self._count(tries, False, 1.0, len(pos) / len(rows))
            return Selection([(0, j) for j in range(G)], 1.0)
        n_pos = min(len(pos), G - min(len(neg), G // 2))
        picks = [pos[i] for i in sorted(self.rng.choice(len(pos), n_pos, replace=False))]
        picks += [neg[i] for i in sorted(self.rng.choice(len(neg), G - n_pos, replace=False))]
        picked = [tries[t][1][j] for t, j in picks]
        w = self._weight(k1, G, picked, len(pos), len(rows), self.estimator)
        self._count(tries, True, w, len(pos) / len(rows))
        return Selection(picks, w)


class AdaSeq(_Pooled):
    """Reinforce-Ada-Seq: extend at the pilot's level until the pool holds >= min_pos positives and >= min_neg
    negatives (balanced variant: both G/2), or `max_rounds` tries. A pool still collapsed on a side whose pilot
    weight h is 0 is not extended (extend='auto'; see the module docstring)."""

    name = "ada-seq"

    def __init__(self, max_rounds: int = 4, weighting: str = "none", objective: str | None = None,
                 estimator: Literal["pilot", "pool"] = "pilot", extend: _Pooled.Extend = "auto",
                 min_pos: int = 1, min_neg: int = 1, num_generations: int | None = None,
                 scale_rewards: str = "group", seed: int = 0):
        super().__init__(max_rounds, weighting, objective, estimator, extend, num_generations, scale_rewards, seed)
        if min_pos < 1 or min_neg < 1:
            raise ValueError("min_pos and min_neg must be >= 1")
        self.min_pos, self.min_neg = int(min_pos), int(min_neg)

    def next_action(self, pid: str, tries: Tries) -> Action | None:
        if len(tries) >= self.max_rounds:
            return None
        level, G = tries[0][0], len(tries[0][1])
        rewards = [r for lvl, rs in tries if lvl == level for r in rs]
        k = _k(rewards)
        if k == 0 or k == len(rewards):
            return Action(level, "extend") if self._extends(k > 0, G) else None
        if k >= self.min_pos and len(rewards) - k >= self.min_neg:
            return None
        return Action(level, "extend")


class AdaEst(_Pooled):
    """Reinforce-Ada-Est: the pilot's p^ = (k1+1)/(G+2) fixes the prompt's rounds n = clip(round(c / p^), 1,
    max_rounds) with no sequential stopping; c is refitted once per step on the earlier steps' pilots (the last
    `history` of them) so their mean allocation is `avg_rounds`, as closely as whole rounds allow (the same total
    budget as any method spending avg_rounds * G per prompt; the fit counts what rounds_for gives each pilot). A
    pilot collapsed on a side whose weight h is 0 gets no extra round (extend='auto').
    The trainer asks next_action for every group before it finalizes any, which is what keeps c fixed in a step."""

    name = "ada-est"

    def __init__(self, max_rounds: int = 4, weighting: str = "none", objective: str | None = None,
                 estimator: Literal["pilot", "pool"] = "pilot", extend: _Pooled.Extend = "auto",
                 avg_rounds: float = 2.0, history: int = 512, num_generations: int | None = None,
                 scale_rewards: str = "group", seed: int = 0):
        super().__init__(max_rounds, weighting, objective, estimator, extend, num_generations, scale_rewards, seed)
        if avg_rounds < 1:
            raise ValueError(f"avg_rounds must be >= 1, got {avg_rounds}")
        self.avg_rounds = float(avg_rounds)
        self.history: deque[float] = deque(maxlen=history)
        self._alloc: dict[str, int] = {}
        self._c_step: float | None = None  # c of the current step (refitted after each step's finalize)

    def _c(self) -> float:
        """c such that mean over the earlier pilots of clip(c / p^, 1, max_rounds) = avg_rounds (bisection); with
        no history yet, over one pilot of each count k = 0..G. Fixed within a step, so n depends on k1 alone."""
        if self._c_step is None:
            self._c_step = self._fit_c()
        return self._c_step

    def _fit_c(self) -> float:
        """Bisection on the allocation `rounds_for` gives (rounded, and 1 for a collapsed pilot on a side that is
        not re-sampled), so the pilots' mean rounds are avg_rounds as closely as whole rounds allow."""
        G = self.G or 8
        ps = np.asarray(self.history or [smoothed_pass_rate(k, G) for k in range(G + 1)], dtype=float)
        target = min(self.avg_rounds, float(self.max_rounds))
        lo, hi = 0.0, float(self.max_rounds) / max(float(ps.min()), 1e-9) + 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if self._allocation(mid, ps, G).mean() < target:
                lo = mid
            else:
                hi = mid
        # the mean is a step function of c: take the side of the step nearer the target
        below, above = self._allocation(lo, ps, G).mean(), self._allocation(hi, ps, G).mean()
        return lo if target - below < above - target else hi

    def _allocation(self, c: float, ps: np.ndarray, G: int) -> np.ndarray:
        """Total tries of pilots with smoothed pass rates `ps` under c (what rounds_for gives)."""
        n = np.clip(np.floor(c / ps + 0.5), 1, self.max_rounds)
        for k in (0, G):  # a pilot collapsed on a side that is not re-sampled gets no extra round
            if not self._extends(k == G, G):
                n = np.where(np.isclose(ps, smoothed_pass_rate(k, G)), 1.0, n)
        return n

    def rounds_for(self, k1: int, G: int) -> int:
        """Total tries for a prompt whose pilot had k1 successes (uses the current history)."""
        if k1 in (0, G) and not self._extends(k1 == G, G):
            return 1
        if self.G is None:
            self.G = G
        n = self._c() / smoothed_pass_rate(k1, G)
        return int(min(max(math.floor(n + 0.5), 1), self.max_rounds))

    def next_action(self, pid: str, tries: Tries) -> Action | None:
        level, G = tries[0][0], len(tries[0][1])
        if pid not in self._alloc:  # the trainer asks every round, also after a None: allocate once per step
            self._alloc[pid] = self.rounds_for(_k(tries[0][1]), G)  # c from earlier steps' pilots: n from k1 alone
        if len(tries) >= min(self._alloc[pid], self.max_rounds):
            return None
        return Action(level, "extend")

    def lookahead(self, pid: str, tries: Tries, action: Action) -> list[Action]:
        # the rounds were allocated from the pilot alone, with no stopping: every one of them will be asked for
        return [action] * max(min(self._alloc.get(pid, 0), self.max_rounds) - len(tries) - 1, 0)

    def finalize(self, pid: str, tries: Tries) -> Selection:
        self._alloc.pop(pid, None)
        self._c_step = None  # the step is over: the next one refits c on the pilots seen so far
        return super().finalize(pid, tries)

    def observe(self, pid: str, level: int, rewards: list[float], pilot: list[float] | None = None) -> None:
        """The pilot joins the history c is fitted on. Every process observes every group of the step, in one order
        (and a resumed run replays them from the tracker's pilot rewards), so c is the same on all of them; a
        process's own next_action calls see only its own groups."""
        if pilot:
            self.history.append(smoothed_pass_rate(_k(pilot), len(pilot)))

    def state(self) -> dict:
        return {"history": list(self.history)}

    def load_state(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))
        self._c_step = None


class SageLightAdaSeq(AdaSeq):
    """SAGE-LIGHT levels + ada-seq sampling at that level. The level rule sees the pilot's accuracy (the group
    SAGE-LIGHT itself would have rolled), not the balanced trained group, whose pass rate is ~1/2 by design.
    The exact statement (*) holds at the tracked level with fixed or teacher hints (one text per prompt and level);
    online hints write a new hint each round, so rows of a round share a hint: log's h (linear in k1) stays
    unbiased for the hint-averaged pass rate, but the derivation's "rows independent given rewards" holds only per
    hint, so there it is an approximation."""

    name = "sage-light+ada-seq"
    uses_hints = True

    def __init__(self, light_min: float = 0.1, light_max: float = 0.35, max_rounds: int = 4,
                 weighting: str = "none", objective: str | None = None,
                 estimator: Literal["pilot", "pool"] = "pilot", extend: _Pooled.Extend = "auto",
                 min_pos: int = 1, min_neg: int = 1, num_generations: int | None = None,
                 scale_rewards: str = "group", seed: int = 0):
        super().__init__(max_rounds, weighting, objective, estimator, extend, min_pos, min_neg, num_generations,
                         scale_rewards, seed)
        self.light = SAGELight(light_min, light_max)

    def level_before(self, pid: str) -> int:
        return self.light.level_before(pid)

    def observe(self, pid: str, level: int, rewards: list[float], pilot: list[float] | None = None) -> None:
        # the level rule sees the pilot (the trainer passes it live, and the tracker keeps it for resume replays)
        self.light.observe(pid, level, pilot if pilot is not None else rewards)

    def state(self) -> dict:
        return self.light.state()

    def load_state(self, state: dict) -> None:
        self.light.load_state(state)


# ---------------------------------------------------------------------------------------------- weighting
class Weighted(Scheduler):
    """Objective f for any scheduler: the inner selection's weight times h(k) S_ref / S_sel, k the successes of
    the trained group (exact (*) for grpo and sage-light, whose trained group is not chosen by its own rewards;
    approximate for sage, which trains the first hint level with a success)."""

    handles_weighting = True

    def __init__(self, inner: Scheduler, objective: str, scale_rewards: str = "group"):
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; choose one of {OBJECTIVES}")
        self.inner, self.objective, self.scale_rewards = inner, objective, scale_rewards
        self.name, self.uses_hints = inner.name, inner.uses_hints

    def level_before(self, pid: str) -> int:
        return self.inner.level_before(pid)

    def next_action(self, pid: str, tries: Tries) -> Action | None:
        return self.inner.next_action(pid, tries)

    def lookahead(self, pid: str, tries: Tries, action: Action) -> list[Action]:
        return self.inner.lookahead(pid, tries, action)

    def finalize(self, pid: str, tries: Tries) -> Selection:
        sel = self.inner.finalize(pid, tries)
        picked = [tries[t][1][j] for t, j in sel.picks]
        s_sel = signal(picked, self.scale_rewards)
        if s_sel <= 0:
            return sel
        G = len(picked)
        h = pilot_weight(_k(picked), G, self.objective)
        return Selection(sel.picks, float(sel.weight * h * reference_signal(G, self.scale_rewards) / s_sel))

    def observe(self, pid: str, level: int, rewards: list[float], pilot: list[float] | None = None) -> None:
        self.inner.observe(pid, level, rewards, pilot)

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics() if hasattr(self.inner, "metrics") else {}

    def __getattr__(self, name):  # e.g. `levels` of a wrapped SAGE-LIGHT
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def with_weighting(scheduler: Scheduler, weighting: str | None, scale_rewards: str = "group") -> Scheduler:
    """`scheduler` training objective `weighting` (RunSpec.weighting). Curation schedulers read `weighting`
    themselves and are returned as they are, as is every scheduler for 'none'."""
    if weighting in (None, "none") or getattr(scheduler, "handles_weighting", False):
        return scheduler
    return Weighted(scheduler, weighting, scale_rewards)


# ---------------------------------------------------------------------------------------------- registry
CURATION_SCHEDULERS: dict[str, type[Scheduler]] = {
    "dapo-filter": DapoFilter,
    "ada-seq": AdaSeq,
    "ada-est": AdaEst,
    "sage-light+ada-seq": SageLightAdaSeq,
}


def register() -> None:
    """Add the curation methods to `schedulers.SCHEDULERS` (idempotent; done on import)."""
    SCHEDULERS.update(CURATION_SCHEDULERS)


register()

__all__ = [
    "OBJECTIVES",
    "AdaEst",
    "AdaSeq",
    "DapoFilter",
    "SageLightAdaSeq",
    "Weighted",
    "exact_signal",
    "expected_signal",
    "pilot_weight",
    "pool_weight",
    "reference_signal",
    "register",
    "signal",
    "target_weight",
    "trl_advantages",
    "with_weighting",
]
