"""Hint drafts: a greedy hint is checked, in one forward, against the hint last written for the same request.

With hint_temperature 0 (the default, as the paper's code) the policy writes a hint by greedy decoding of
pi(.|request). Between two visits of one request (a prompt at a level) the policy moves by a few updates, and its
greedy hint mostly stays the same (tiny-cpu SAGE: 48 of 50 revisits wrote the same hint). So the last hint is a
draft, as in speculative decoding with the old hint as the drafter: one forward over request + draft gives the
argmax after every prefix of the draft; the longest prefix whose every token is that argmax is what greedy decoding
writes, and the argmax after it is its next token. A draft matched up to its end (EOS, or the token limit) is the
hint without a decode loop; a partly matched one goes on decoding from its matched prefix plus that token. The hint
is greedy decoding's, up to float rounding between one forward and the decode loop (a near-tie of two tokens).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import torch
from torch import nn

LOGITS_PER_CALL = 2**27  # logits one check's forward holds at most (rows x positions x vocab): 512 MB in float32


class HintDrafts:
    """The last greedy hint (token ids) of each hint request (its prompt's token ids), and the check of a draft."""

    def __init__(self, eos_token_ids: Sequence[int], pad_token_id: int):
        self.eos, self.pad = frozenset(int(t) for t in eos_token_ids), int(pad_token_id)
        self._drafts: dict[bytes, array] = {}

    @staticmethod
    def _key(prompt_ids: Sequence[int]) -> bytes:
        return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).digest()

    def __len__(self) -> int:
        return len(self._drafts)

    def remember(self, prompt_ids: Sequence[int], hint_ids: Sequence[int]) -> None:
        """The greedy hint just written for this request: the next visit's draft (4 bytes a token)."""
        self._drafts[self._key(prompt_ids)] = array("i", hint_ids)

    def get(self, prompt_ids: Sequence[int]) -> list[int] | None:
        draft = self._drafts.get(self._key(prompt_ids))
        return None if draft is None else draft.tolist()

    @torch.no_grad()
    def check(self, model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int
              ) -> list[tuple[list[int], bool] | None]:
        """For each prompt with a draft: (the tokens greedy decoding writes first, whether the hint ends there: at
        an EOS or at max_new_tokens); None for one without. Forwards over the prompts with drafts, as few as keep
        their logits under LOGITS_PER_CALL."""
        out: list[tuple[list[int], bool] | None] = [None] * len(prompts)
        todo = [(i, list(p), d[:max_new_tokens]) for i, p in enumerate(prompts)
                if max_new_tokens > 0 and (d := self.get(p))]
        if not todo:
            return out
        device = next(model.parameters()).device
        vocab = model.get_output_embeddings().weight.shape[0]
        per_call = max(1, LOGITS_PER_CALL // ((max(len(d) for _, _, d in todo) + 1) * vocab))
        for start in range(0, len(todo), per_call):
            part = todo[start:start + per_call]
            width, keep = max(len(p) + len(d) for _, p, d in part), max(len(d) for _, _, d in part) + 1
            ids = torch.full((len(part), width), self.pad, dtype=torch.long, device=device)
            mask = torch.zeros_like(ids)
            for r, (_, p, d) in enumerate(part):  # left-padded, as generate lays out a batch
                ids[r, width - len(p) - len(d):] = torch.tensor(p + d, device=device)
                mask[r, width - len(p) - len(d):] = 1
            # positions counted from each row's first token, as generate counts them (absolute position embeddings
            # read them; rotary ones would only be shifted by a row's padding)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
            for (i, _, d), best in zip(part, logits.argmax(-1).tolist(), strict=True):
                greedy = best[keep - 1 - len(d):]  # greedy[j]: greedy decoding's token after p + d[:j]
                k = next((j for j, t in enumerate(d) if greedy[j] != t), len(d))
                tokens = d[:k] + [greedy[k]] if k < len(d) or d[-1] not in self.eos else d
                tokens = tokens[:max_new_tokens]
                out[i] = (tokens, tokens[-1] in self.eos or len(tokens) >= max_new_tokens)
        return out
