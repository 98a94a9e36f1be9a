"""HF generate's cache for a batch of groups: each distinct prompt prefilled once, every row's keys appended in place.

A group's G rows repeat one prompt, and generate's own prefill runs each of them: G times the prompt's tokens. Here
the prompt minus its last token runs once per distinct prompt, its keys and values are copied to the rows that
repeat it, and generate, handed that cache, runs only each row's last prompt token before decoding. Positions are
generate's own (the mask's running count where the forward takes position_ids, so a row's left padding does not
shift it), so the logits are its own up to float rounding: that token attends through the cache rather than inside
one forward. A sampled token differs only where a draw falls within rounding of a tie.

DynamicLayer concatenates each step's key onto the cache, copying the whole cache every step (on CPU that copy was
about a third of a decode step at 64 rows). The rows' layers here are `AppendLayer`s: a buffer that doubles when full,
up to the prompt plus the completion, written in place (the same values, so the same logits).

Needs a cache of full-attention layers (`DynamicLayer`); any other raises CacheUnsupported before generate runs.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .shared_prefix import DynamicCache, DynamicLayer, first_rows, full_attention_layers, prompt_groups


class AppendLayer(DynamicLayer or object):  # (transformers without layered caches: never built)
    """A DynamicLayer whose keys and values are views of a larger buffer: an update writes its positions in place.
    The buffer doubles when full (at most to `limit` positions, what the layer is expected to hold: prompt plus
    completion), so a completion that stops early never holds memory for the longest one, and the copies stay linear
    in its length (DynamicLayer copies the whole cache at every step). A batch change (beam reordering, row
    selection, a reset) starts a new buffer from the keys so far; `keys`/`values` keep DynamicLayer's shapes and
    meaning."""

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit = limit
        self._buf: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t, n = self.get_seq_length(), key_states.shape[-2]
        buf = self._buf
        # the dtypes torch.cat would give (DynamicLayer's): a bf16 cache meeting fp32 states holds fp32 from then on
        kd = torch.promote_types(self.keys.dtype, key_states.dtype) if t else key_states.dtype
        vd = torch.promote_types(self.values.dtype, value_states.dtype) if t else value_states.dtype
        if (buf is None or t + n > buf[0].shape[-2] or self.keys.data_ptr() != buf[0].data_ptr()
                or buf[0].shape[0] != key_states.shape[0] or buf[0].dtype != kd or buf[1].dtype != vd):
            size = max(2 * (t + n), t + n + 16)
            if self.limit is not None and self.limit >= t + n and size * 3 // 2 >= self.limit:
                size = self.limit  # near the expected length: all of it at once
            B, H, _, D = key_states.shape
            buf = (key_states.new_empty(B, H, size, D, dtype=kd),
                   value_states.new_empty(B, H, size, value_states.shape[-1], dtype=vd))
            if t:
                buf[0][:, :, :t] = self.keys
                buf[1][:, :, :t] = self.values
            self._buf = buf
        buf[0][:, :, t:t + n] = key_states
        buf[1][:, :, t:t + n] = value_states
        self.keys, self.values = buf[0][:, :, :t + n], buf[1][:, :, :t + n]
        return self.keys, self.values

    def reset(self) -> None:
        self._buf = None
        super().reset()


def generating_module(model: nn.Module) -> nn.Module:
    """The module whose forward generate runs: a PEFT model's generate is its base model's (adapters injected), and
    the base model's forward, not the PEFT wrapper's (which accelerate may have wrapped in autocast)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _takes_positions(model: nn.Module) -> bool:
    """Whether generate passes position_ids to this model's forward: it does where the forward names them."""
    return "position_ids" in inspect.signature(model.forward).parameters


def generation_cache(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int):
    """The cache to hand generate for this left-padded batch: each row's prompt minus its last token, each distinct
    prompt computed once, in AppendLayers expecting `new_tokens` more positions; None when no prompt repeats
    (generate's own prefill then costs no more). Raises CacheUnsupported when the model's cache is not one of
    full-attention layers."""
    if DynamicCache is None:
        return None
    groups = torch.tensor(prompt_groups(input_ids, attention_mask), device=input_ids.device)
    if input_ids.size(1) < 2 or not groups.numel() or int(groups.max()) + 1 == input_ids.size(0):
        return None
    first = first_rows(groups)
    kw, model = {}, generating_module(model)  # the prefill runs as generate's own forwards will (autocast or not)
    if _takes_positions(model):  # generate then passes the mask's running count (else the model counts from 0)
        kw["position_ids"] = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[first, :-1]
    pre = model(input_ids=input_ids[first, :-1], attention_mask=attention_mask[first, :-1], use_cache=True,
                logits_to_keep=1, **kw)
    layers = full_attention_layers(pre)  # raises CacheUnsupported for any other kind
    rows = DynamicCache()
    rows.layers = []
    for layer in layers:
        mine = AppendLayer(limit=input_ids.size(1) + new_tokens)  # the prompt, then every decode step's token
        mine.update(layer.keys.index_select(0, groups), layer.values.index_select(0, groups))
        rows.layers.append(mine)
    return rows
