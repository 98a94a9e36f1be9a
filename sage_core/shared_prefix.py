"""The loss's forward with each prompt computed once: a group's G rows share their prompt, hinted or not.

A row's log-probs are log pi(c_t | x, c_<t). Cut the row before the prompt's last token: the prefix x[:-1] runs once
per distinct prompt and leaves its keys and values in a cache; the chunk [x[-1], c] runs once per row against the
cache of its prompt (x[-1]'s output scores c_0, each c_t's scores c_t+1). Every token attends to the same keys and
values at the same positions as in one forward of the whole row, so log-probs, entropies and gradients are the
plain forward's, up to float rounding; gradients reach the prompt's tokens through the cache. A prompt then costs
1/G of its tokens: SAGE's hinted prompts are long (the hint), so the update gains most where it trains most.

Needs a cache of full-attention layers (`DynamicLayer`; sliding-window, recurrent and other caches make the forward
the plain one) and, with gradients, no gradient checkpointing (it turns the cache off in training).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

try:
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - transformers without layered caches: no sharing
    DynamicCache = DynamicLayer = None


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[int]:
    """Each row's group: rows with the same prompt tokens (the same left-padded width and mask) share one."""
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)
    return torch.unique(key, dim=0, return_inverse=True)[1].tolist()


def first_rows(groups: torch.Tensor) -> torch.Tensor:
    """The first row of each group, for groups numbered 0..n-1 as prompt_groups numbers them."""
    rows = torch.arange(groups.numel(), device=groups.device)
    return torch.full((int(groups.max()) + 1,), groups.numel(), device=groups.device).scatter_reduce(
        0, groups, rows, reduce="amin")


def _replicator(groups: torch.Tensor):
    """`t -> t[groups]` (each row gets its prompt's slice) with a backward that sums a prompt's row gradients in a
    fixed order. Plain `t[groups]` accumulates them with index_put(accumulate=True), whose order PyTorch does not fix
    (nondeterministic on CPU; seen: weights 1 ulp apart between two identical resumed runs). Here each row reads its
    own slot of the prompt's slice expanded to the largest group, so the indexing's backward writes every slot once
    and the expand's backward, an ordinary sum over the slots, adds them up. The price: that backward holds a
    prompts x largest-group buffer per layer's keys and values for a moment (rows x 1 for even groups; more where a
    bucket mixes one large group with single rows)."""
    counts = torch.bincount(groups)
    order = torch.argsort(groups, stable=True)
    slot = torch.empty_like(groups)
    slot[order] = torch.arange(groups.numel(), device=groups.device) - (torch.cumsum(counts, 0) - counts)[groups[order]]
    width = int(counts.max())

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(1).expand(t.size(0), width, *t.shape[1:])[groups, slot]

    return rows


def usable(model: nn.Module, with_grad: bool) -> bool:
    """Whether a forward may pass a cache: with gradients, gradient checkpointing turns it off (transformers'
    GradientCheckpointingLayer drops the cache while training), and this forward needs it."""
    if DynamicCache is None:
        return False
    return not (with_grad and model.training and any(getattr(m, "gradient_checkpointing", False) is True
                                                     for m in model.modules()))


def cache_kwarg(model: nn.Module) -> str:
    """The forward's name for a cache: `cache` (transformers >= 5.24), `past_key_values` before; read from the first
    module (the model itself, or the one a DDP or PEFT wrapper holds) whose forward takes either."""
    return _cache_name(model) or "past_key_values"


def takes_cache(model: nn.Module) -> bool:
    """Whether some module of `model` (it, or the one a wrapper holds) has a forward that takes a cache."""
    return _cache_name(model) is not None


def _cache_name(model: nn.Module) -> str | None:
    for m in model.modules():
        params = _params(m)
        if "cache" in params or "past_key_values" in params:
            return "cache" if "cache" in params else "past_key_values"
    return None


def _params(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return set()


class CacheUnsupported(RuntimeError):
    """The model's cache is not plain full attention (sliding windows, recurrent state, quantized, none)."""


def full_attention_layers(output) -> list:
    """The layers of the cache a forward returned; CacheUnsupported unless every one is a plain full-attention
    DynamicLayer (not a sliding-window, recurrent or quantized one)."""
    cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        raise CacheUnsupported(f"{type(cache).__name__} with layers {sorted({type(x).__name__ for x in layers or []})}")
    return layers


def forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
            compute_entropy: bool, autocast) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the last `logits_to_keep` tokens of each row, as TRL's fused forward
    gives them, with each distinct prompt (the tokens before) computed once. The model must carry TRL's fused LM
    head (`fused_lm_head=True`). Raises CacheUnsupported, before any row is scored, when the model's cache is not
    one of full-attention layers."""
    C = logits_to_keep
    P = input_ids.size(1) - C
    if P < 2:
        raise ValueError(f"a shared prompt needs at least 2 prompt columns, got {P}")
    groups = torch.tensor(prompt_groups(input_ids[:, :P], attention_mask[:, :P]), device=input_ids.device)
    first = first_rows(groups)
    name = cache_kwarg(model)
    with autocast():
        pre = model(input_ids=input_ids[first, :P - 1], attention_mask=attention_mask[first, :P - 1], use_cache=True,
                    logits_to_keep=1)
    layers = full_attention_layers(pre)
    of_rows = _replicator(groups)
    rows = DynamicCache(ddp_cache_data=[(of_rows(layer.keys), of_rows(layer.values)) for layer in layers])
    chunk = input_ids[:, P - 1:]
    labels = chunk.masked_fill(attention_mask[:, P - 1:] == 0, -100)
    labels[:, 0] = -100  # the prompt's last token is input only
    with autocast():
        out = model(input_ids=chunk, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                    **{name: rows})
    if rows.get_seq_length() != P - 1 + chunk.size(1):  # the forward did not read the cache (a layer dropped it)
        raise CacheUnsupported(f"a cache the model's forward did not read ({rows.get_seq_length()} positions after "
                               f"a chunk of {chunk.size(1)} on a prompt of {P - 1})")
    return out.log_probs[:, -C:], (out.entropy[:, -C:] if compute_entropy else None)
