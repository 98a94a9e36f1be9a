"""Hint prefetch: the next step's greedy hint requests ride in this step's rollout pass, as drafts.

SAGE-LIGHT knows each prompt's hint level before the prompt's step (the level its history set), and the data loader
has the next batch ready. A hint request of that batch with no draft (a prompt's first visit at its level: most
requests of a first epoch) would need a decode loop of its own at the next step, before that step's rollout can
start: one sequential forward per hint token. Here each request of the next batch (drafted or not, so that the rows
that join a pass depend on what a checkpoint keeps, not on the drafts) is appended to this step's rollout batch: its
row decodes greedily (every logit but the argmax masked, before the rollout's temperature, top-k and top-p, which
then have one token to keep) and stops at hint_max_tokens. What it writes is the greedy hint of the policy one
update before the step that asks for it: a draft (sage_core.hint_drafts), which that step checks in one forward
with its own policy. The hint is that policy's greedy hint either way; where the update did not change it, no
decode loop runs for it.

Where a decode step costs the same for a few rows more (a GPU), the rows should cost little and the next step's hint
loop is gone (not measured on a GPU yet). Where rows cost in proportion (CPU), the added rows, which also widen the
batch's padding to the requests' length, cost more than the loop they save: off by default.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
from transformers import LogitsProcessor, StoppingCriteria


class GreedyRows(LogitsProcessor):
    """Rows from `first` on decode greedily: all but each row's argmax set to -inf (the rows before are untouched).
    The sampling warpers that follow keep a row's only finite token, so the draw is the argmax."""

    def __init__(self, first: int):
        self.first = first

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tail = scores[self.first:]
        if not tail.numel():
            return scores
        best = tail.argmax(-1, keepdim=True)
        greedy = torch.full_like(tail, float("-inf")).scatter(-1, best, tail.gather(-1, best))
        return torch.cat([scores[:self.first], greedy])


class StopRowsAt(StoppingCriteria):
    """Rows from `first` on are done once they hold `limit` new tokens (the prompt is `width` tokens wide)."""

    def __init__(self, first: int, width: int, limit: int):
        self.first, self.width, self.limit = first, width, limit

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[1] - self.width >= self.limit:
            done[self.first:] = True
        return done


class Lookahead:
    """An epoch's batch iterator that has read some batches ahead: next() gives them first, in order."""

    def __init__(self, source: Iterator):
        self.source, self.ahead, self.ended = source, deque(), False  # ended: the source has no batch left

    def __iter__(self):
        return self

    def __next__(self):
        return self.ahead.popleft() if self.ahead else next(self.source)

    def fill(self, n: int) -> None:
        """Read ahead until `n` batches wait (fewer at the epoch's end)."""
        while len(self.ahead) < n:
            try:
                self.ahead.append(next(self.source))
            except StopIteration:
                self.ended = True
                return

    def next_other(self, prompt_ids: list[str]) -> list[dict]:
        """The first batch read ahead whose prompts are not `prompt_ids` (TRL's sampler repeats a generation batch
        for each of its optimizer steps and iterations): the next step's rows, or [] where none is read yet."""
        for batch in self.ahead:
            if isinstance(batch, list) and [r.get("prompt_id") for r in batch] != prompt_ids:
                return batch
        return []
