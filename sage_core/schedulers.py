"""Schedulers decide, per prompt group, which hint level to roll out at and what to do after seeing rewards.

The trainer asks three questions, always about a prompt id (never a batch position):
  level_before(pid)            -> the level of the first rollout of this step (SAGE-LIGHT: the tracked level)
  next_action(pid, tries)      -> after the rollouts so far, roll again (Action) or stop (None)
  lookahead(pid, tries, action) -> the actions that would follow `action` if its rollouts fail too (optional): the
                               trainer may roll them in the same pass and keeps only those next_action then asks for
  finalize(pid, tries)         -> which rolled rows form the trained group (and a weight on its advantages)
  observe(pid, level, rewards, pilot) -> bookkeeping once the step's final group is known (`pilot`: the first
                               try's rewards, at level_before; every process observes every group)
`tries` is the list of (level, rewards) rolled for this prompt in this step, in order.

grpo:       never hints.
sage:       on an all-zero group, try levels 1, 2, 3 in turn, re-rolling only that group, and stop at the first
            level with a success (all-one groups are not hinted: hints only make them easier).
sage-light: one rollout per step at the prompt's tracked level; after it, raise the level when the accuracy is
            <= light_min, lower it when > light_max (levels stay in 0..3). Where the tracked level's hint fails
            (leaked, missing) the trainer rolls at the highest lower level that has one: that level is observed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

from .gate import collapsed, pass_rate
from .prompts import LEVELS

MAX_LEVEL = LEVELS[-1]


@dataclass(frozen=True)
class Action:
    """Roll the group again at `level`. `mode='replace'` swaps the group if the new rollouts are kept;
    `mode='extend'` adds them to the prompt's pool (used by sampling methods that downsample a pool to G);
    `mode='new_prompt'` swaps the group for a fresh prompt from the train set (DAPO dynamic sampling)."""

    level: int
    mode: Literal["replace", "extend", "new_prompt"] = "replace"


Tries = list[tuple[int, list[float]]]


@dataclass(frozen=True)
class Selection:
    """The group that is trained on: `picks` are (try index, row index within that try), G of them, and `weight`
    multiplies the group's advantages (1 for unweighted methods)."""

    picks: list[tuple[int, int]]
    weight: float = 1.0


class Scheduler:
    name = "base"
    uses_hints = False

    def level_before(self, pid: str) -> int:
        return 0

    def next_action(self, pid: str, tries: Tries) -> Action | None:
        return None

    def lookahead(self, pid: str, tries: Tries, action: Action) -> list[Action]:
        """Actions next_action would ask for after `action` if its rollouts and each following one fail: a guess the
        trainer may roll ahead in one pass. Wrong guesses cost rollouts, never correctness: the trainer replays
        next_action over the rolled tries and drops the ones it does not ask for."""
        return []

    def finalize(self, pid: str, tries: Tries) -> Selection:
        """Default: train on the last try whose group is mixed, else on the first try (no hint for sage)."""
        chosen = next((i for i in range(len(tries) - 1, -1, -1) if tries[i][1] and not collapsed(tries[i][1])), 0)
        return Selection([(chosen, j) for j in range(len(tries[chosen][1]))])

    def observe(self, pid: str, level: int, rewards: list[float], pilot: list[float] | None = None) -> None:
        pass

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


class GRPO(Scheduler):
    name = "grpo"


class SAGE(Scheduler):
    name = "sage"
    uses_hints = True

    def next_action(self, pid: str, tries: Tries) -> Action | None:
        level, rewards = tries[-1]  # rewards is empty when no usable hint could be written at that level
        if any(r > 0 for r in rewards) or level >= MAX_LEVEL:  # a success (or out of levels): stop searching
            return None
        return Action(level + 1)

    def lookahead(self, pid: str, tries: Tries, action: Action) -> list[Action]:
        return [Action(lvl) for lvl in range(action.level + 1, MAX_LEVEL + 1)]

    def finalize(self, pid: str, tries: Tries) -> Selection:
        """The level the search stopped at when it stopped on a success (mixed rewards, or all correct: advantage 0,
        but that is the hint that was used); else, every level failed, the unhinted group (advantage 0)."""
        last = len(tries) - 1
        if any(r > 0 for r in tries[last][1]):
            return Selection([(last, j) for j in range(len(tries[last][1]))])
        return super().finalize(pid, tries)


class SAGELight(Scheduler):
    name = "sage-light"
    uses_hints = True

    def __init__(self, light_min: float = 0.1, light_max: float = 0.35):
        if light_min > light_max:
            raise ValueError(f"light_min ({light_min}) must be <= light_max ({light_max})")
        self.light_min, self.light_max = light_min, light_max
        self.levels: dict[str, int] = {}

    def level_before(self, pid: str) -> int:
        return self.levels.get(pid, 0)

    def observe(self, pid: str, level: int, rewards: list[float], pilot: list[float] | None = None) -> None:
        acc = pass_rate(rewards)
        if acc <= self.light_min:
            level = min(level + 1, MAX_LEVEL)
        elif acc > self.light_max:
            level = max(level - 1, 0)
        self.levels[pid] = level

    def state(self) -> dict:
        return {"levels": dict(self.levels)}

    def load_state(self, state: dict) -> None:
        self.levels = dict(state.get("levels", {}))


SCHEDULERS: dict[str, type[Scheduler]] = {"grpo": GRPO, "sage": SAGE, "sage-light": SAGELight}


def make_scheduler(method: str, **kwargs) -> Scheduler:
    """Build the scheduler of a method name; kwargs a scheduler does not take are ignored. `weighting` (a prompt
    objective f, trained through a group weight estimating f'(p) p (1-p): curation.Weighted) wraps schedulers that do
    not weight groups themselves; the curation methods read it themselves ('none': Reinforce-Ada's log p for
    ada-seq, ada-est and sage-light+ada-seq)."""
    if method not in SCHEDULERS:
        raise ValueError(f"unknown method {method!r}; choose one of {sorted(SCHEDULERS)}")
    cls = SCHEDULERS[method]
    params = inspect.signature(cls.__init__).parameters
    scheduler = cls(**{k: v for k, v in kwargs.items() if k in params})
    return curation.with_weighting(scheduler, kwargs.get("weighting", "none"), kwargs.get("scale_rewards", "group"))


from . import curation  # noqa: E402  (registers dapo-filter, ada-seq, ada-est, sage-light+ada-seq)
