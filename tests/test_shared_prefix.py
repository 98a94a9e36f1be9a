"""Shared prompts in the loss's forward: each distinct prompt computed once, the loss given the same tensors."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_core import shared_prefix
from sage_core.packing import length_buckets, padded_area, prompt_buckets


def _cost(p, c, g, buckets, overhead):
    """Token slots and overhead of buckets as prompt_buckets prices them."""
    total = 0
    for rows, shared in buckets:
        wp, wc = max(p[r] for r in rows), max(c[r] for r in rows)
        if shared:
            total += len({g[r] for r in rows}) * max(wp - 1, 0) + len(rows) * (wc + 1) + 2 * overhead
        else:
            total += len(rows) * (wp + wc) + overhead
    return total


groups_st = st.lists(st.tuples(st.integers(0, 60), st.lists(st.integers(0, 40), min_size=1, max_size=4)),
                     min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(groups_st, st.integers(0, 300), st.booleans(), st.sampled_from([None, 1, 2, 3]))
def test_prompt_buckets_beat_every_contiguous_split_at_its_cheaper_layout(units, overhead, share, max_rows):
    p, c, g = [], [], []
    for u, (plen, comps) in enumerate(units):
        p += [plen] * len(comps)
        c += comps
        g += [u] * len(comps)
    buckets = prompt_buckets(p, c, g, overhead, share, max_rows=max_rows)
    assert sorted(r for b, _ in buckets for r in b) == list(range(len(p)))
    for rows, shared in buckets:  # a shared bucket holds a repeated prompt longer than one token
        assert not shared or (share and len(rows) > len({g[r] for r in rows}) and max(p[r] for r in rows) > 1)
        assert max_rows is None or len(rows) <= max_rows
    # exhaustive: every split of the rows sorted by total length into contiguous runs, each at its cheaper layout
    order = sorted(range(len(p)), key=lambda r: -(p[r] + c[r]))

    def best_layout(rows):
        plain = _cost(p, c, g, [(rows, False)], overhead)
        ok = share and len(rows) > len({g[r] for r in rows}) and max(p[r] for r in rows) > 1
        return min(plain, _cost(p, c, g, [(rows, True)], overhead)) if ok else plain

    best = min(
        sum(best_layout(order[a:b]) for a, b in zip((0, *cuts), (*cuts, len(order)), strict=True))
        for k in range(len(order))
        for cuts in itertools.combinations(range(1, len(order)), k)
        if max_rows is None or all(b - a <= max_rows for a, b in zip((0, *cuts), (*cuts, len(order)), strict=True))
    )
    assert _cost(p, c, g, buckets, overhead) == best


def test_prompt_buckets_without_repeated_prompts_are_length_buckets():
    p, c = [25] * 56 + [55] * 8, [18] * 56 + [38] * 8
    plain = prompt_buckets(p, c, list(range(64)), overhead=256)
    assert not any(shared for _, shared in plain)
    assert padded_area(p, c, [b for b, _ in plain]) == padded_area(p, c, length_buckets(p, c, overhead=256))


def test_prompt_buckets_share_a_groups_prompt_when_it_saves_slots():
    # 7 bare groups of 8 rows (prompt 31) and one hinted group (prompt 54, long completions)
    p, c = [31] * 56 + [54] * 8, [18] * 56 + [38] * 8
    g = [i // 8 for i in range(64)]
    buckets = prompt_buckets(p, c, g, overhead=256)
    assert all(shared for _, shared in buckets)
    assert _cost(p, c, g, buckets, 256) < padded_area(p, c, length_buckets(p, c, 256)) + 256 * 2
    assert not any(shared for _, shared in prompt_buckets(p, c, g, overhead=256, share=False))


def test_a_groups_long_completion_leaves_its_short_ones_to_a_shared_bucket():
    """One long completion in each group (seen in review: whole-group buckets padded every row to it, 2.4x the
    slots of sharing off): the long rows go plain, the short ones share their prompts."""
    p, c = [40] * 32, ([200] + [12] * 7) * 4
    g = [i // 8 for i in range(32)]
    buckets = prompt_buckets(p, c, g, overhead=256)
    assert sorted((len(rows), shared) for rows, shared in buckets) == [(4, False), (28, True)]
    assert _cost(p, c, g, buckets, 256) == 4 * 240 + 256 + 4 * 39 + 28 * 13 + 512
    assert _cost(p, c, g, buckets, 256) < padded_area(p, c, length_buckets(p, c, 256)) + 256 * 2


def test_bad_prompt_bucket_input_is_named():
    with pytest.raises(ValueError, match="1-D of one length"):
        prompt_buckets([1, 2], [1, 2], [0])
    with pytest.raises(ValueError, match="max_rows"):
        prompt_buckets([3, 4], [1, 2], [0, 0], max_rows=0)
    with pytest.raises(ValueError, match="overhead"):
        prompt_buckets([1], [1], [0], overhead=-1)
    assert prompt_buckets([], [], []) == []


def test_prompt_groups_tell_prompts_apart_by_tokens_and_padding():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [5, 5, 6], [0, 5, 7], [9, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]])
    g = shared_prefix.prompt_groups(ids, mask)
    assert g[0] == g[1] == g[4]  # a padded position's token does not matter
    assert len({g[0], g[2], g[3]}) == 3


# ---------------------------------------------------------------------------------------------- the forward
def _grouped_batch(tok, rng, prompt_lens=(25, 31, 55), comp_lens=((18, 3, 18), (38, 30, 0), (12, 40, 7))):
    """Groups of rows sharing a left-padded prompt, with right-padded completions of varied lengths (TRL's layout)."""
    prompts = [rng.integers(5, 400, n).tolist() for n in prompt_lens]
    rows = [(prompts[u], rng.integers(5, 400, n).tolist()) for u, lens in enumerate(comp_lens) for n in lens]
    P, C = max(prompt_lens), max(n for lens in comp_lens for n in lens)
    ids = torch.full((len(rows), P + C), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, P - len(p):P], mask[i, P - len(p):P] = torch.tensor(p), 1
        if c:
            ids[i, P:P + len(c)], mask[i, P:P + len(c)] = torch.tensor(c), 1
    return ids, mask, C, mask[:, P:]


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    return build_trainer(preset("tiny-cpu", method="grpo", num_prompts=8, prompts_per_step=2, max_steps=1),
                         tmp_path_factory.mktemp("shared"))


def _prepared(trainer, seed, overhead=16):
    """A grouped batch (seeded), the model in training mode, and the buckets' per-forward overhead set."""
    batch = _grouped_batch(trainer.processing_class, np.random.default_rng(seed))
    trainer.model.train()
    trainer.args.sage_bucket_overhead = overhead
    return batch


def _spy(model):
    """Record (rows, columns, cache passed, grad mode) of each forward."""
    calls, plain_forward = [], model.forward

    def spy(*a, **k):
        cached = k.get("cache", k.get("past_key_values")) is not None
        calls.append((*k["input_ids"].shape, cached, torch.is_grad_enabled()))
        return plain_forward(*a, **k)

    model.forward = spy
    return calls, plain_forward


def _run(trainer, ids, mask, C, comp_mask, share, **kw):
    model = trainer.model
    trainer.args.sage_shared_prefix = share
    model.zero_grad()
    logps, ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, compute_entropy=True, **kw)
    (logps * comp_mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logps * comp_mask, ent * comp_mask, grads


def _same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=1e-4)
    assert len(a[2]) == len(b[2]) > 0
    for x, y in zip(a[2], b[2], strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3)


def test_shared_prompts_give_the_loss_the_same_logps_entropies_and_gradients(trainer):
    ids, mask, C, comp_mask = _prepared(trainer, 0)
    model = trainer.model
    calls, plain_forward = _spy(model)
    try:
        plain = _run(trainer, ids, mask, C, comp_mask, share=False)
        plain_calls = list(calls)
        calls.clear()
        shared = _run(trainer, ids, mask, C, comp_mask, share=True)
    finally:
        model.forward = plain_forward
    _same(shared, plain)
    assert not any(cached for *_, cached, _ in plain_calls)
    # each row's completion ran against its prompt's cache (9 rows), each prompt once per bucket that holds it
    # (3 prompts; the buckets may part a group's long completion from its short ones)
    prompt_rows = sum(n for n, _, cached, _ in calls if not cached)
    row_chunks = sum(n for n, _, cached, _ in calls if cached)
    assert row_chunks == 9 and 3 <= prompt_rows < 9
    assert sum(n * w for n, w, _, _ in calls) < sum(n * w for n, w, _, _ in plain_calls)


def test_zero_advantage_groups_share_their_prompt_without_a_graph(trainer):
    ids, mask, C, comp_mask = _prepared(trainer, 1)
    model = trainer.model
    calls, plain_forward = _spy(model)
    try:
        trainer._no_grad_rows = torch.tensor([True] * 3 + [False] * 3 + [True] * 3)
        plain = _run(trainer, ids, mask, C, comp_mask, share=False)
        calls.clear()
        shared = _run(trainer, ids, mask, C, comp_mask, share=True)
    finally:
        model.forward, trainer._no_grad_rows = plain_forward, None
    # the dead rows' log-probs are the same; only the live group's carry gradient (the same in both layouts)
    _same(shared, plain)
    assert sum(n for n, _, cached, grad in calls if cached and grad) == 3
    assert sum(n for n, _, cached, grad in calls if cached and not grad) == 6


def test_with_gradient_checkpointing_rows_with_gradients_run_whole(trainer):
    """Gradient checkpointing turns the cache off while training (transformers drops it), so rows that carry
    gradient run whole; rows without a graph still share their prompt."""
    ids, mask, C, comp_mask = _prepared(trainer, 2)
    model = trainer.model
    calls, plain_forward = _spy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        assert not shared_prefix.usable(model, with_grad=True) and shared_prefix.usable(model, with_grad=False)
        trainer._no_grad_rows = torch.tensor([True] * 3 + [False] * 3 + [True] * 3)
        plain = _run(trainer, ids, mask, C, comp_mask, share=False)
        calls.clear()
        shared = _run(trainer, ids, mask, C, comp_mask, share=True)
    finally:
        model.gradient_checkpointing_disable()
        model.forward, trainer._no_grad_rows = plain_forward, None
    _same(shared, plain)
    assert not any(cached for _, _, cached, grad in calls if grad)
    # transformers >= 5.24 keeps the cache of a layer run without gradients; an older one drops it in every layer
    # that checkpoints, and the forward then finds its cache unread and computes those rows whole
    assert sum(n for n, _, cached, grad in calls if cached and not grad) == (6 if not trainer._share_failed else 0)
    trainer._share_failed = False


def test_a_memory_cap_on_rows_per_forward_still_holds(trainer):
    ids, mask, C, comp_mask = _prepared(trainer, 3, overhead=0)
    model = trainer.model
    calls, plain_forward = _spy(model)
    try:
        plain = _run(trainer, ids, mask, C, comp_mask, share=False)
        calls.clear()
        shared = _run(trainer, ids, mask, C, comp_mask, share=True, batch_size=2)
    finally:
        model.forward = plain_forward
    _same(shared, plain)
    assert max(n for n, *_ in calls) <= 2


def test_a_cache_that_is_not_full_attention_makes_the_forward_plain(trainer, monkeypatch, caplog):
    """Sliding-window, recurrent or quantized caches cannot serve a shared prompt: the forward says so once and
    computes every row whole, with the same results."""
    ids, mask, C, comp_mask = _prepared(trainer, 4)
    model = trainer.model
    plain = _run(trainer, ids, mask, C, comp_mask, share=False)
    monkeypatch.setattr(shared_prefix, "DynamicLayer", type("SlidingLayer", (), {}))
    trainer._share_failed = False
    try:
        with caplog.at_level(logging.WARNING, logger="sage_core.trainer"):
            shared = _run(trainer, ids, mask, C, comp_mask, share=True)
        assert trainer._share_failed
        assert "every row's prompt" in caplog.text and "DynamicLayer" in caplog.text
        _same(shared, plain)
        calls, plain_forward = _spy(model)
        try:
            _run(trainer, ids, mask, C, comp_mask, share=True)
        finally:
            model.forward = plain_forward
        assert not any(cached for _, _, cached, _ in calls)  # not tried again
    finally:
        trainer._share_failed = False


def test_the_forward_refuses_a_prompt_too_short_to_split(trainer):
    ids = torch.tensor([[5, 6, 7], [5, 6, 8]])
    with pytest.raises(ValueError, match="at least 2 prompt columns"):
        shared_prefix.forward(trainer.model, ids, torch.ones_like(ids), 2, False, trainer.accelerator.autocast)


def test_the_cache_argument_is_found_through_wrappers(trainer):
    from peft import LoraConfig, get_peft_model

    name = shared_prefix.cache_kwarg(trainer.model)
    assert name in ("cache", "past_key_values")
    assert shared_prefix.cache_kwarg(torch.nn.ModuleList([trainer.model])) == name
    peft_model = get_peft_model(type(trainer.model)(trainer.model.config), LoraConfig(r=2, target_modules=["q_proj"]))
    assert shared_prefix.cache_kwarg(peft_model) == name


def test_lora_adapters_see_the_same_logps_and_gradients_through_a_shared_prompt(tiny_model_dir, tmp_path):
    """With LoRA (PEFT wraps the model; TRL's fused head sits on the base model) the shared forward reaches the
    cache argument through the wrappers, and the adapters' gradients are the plain forward's."""
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    lora = build_trainer(preset("tiny-cpu", method="grpo", num_prompts=8, prompts_per_step=2, max_steps=1, lora_r=4,
                                lora_alpha=8), tmp_path)
    ids, mask, C, comp_mask = _grouped_batch(lora.processing_class, np.random.default_rng(5))
    lora.model.train()
    lora.args.sage_bucket_overhead = 16
    plain = _run(lora, ids, mask, C, comp_mask, share=False)
    shared = _run(lora, ids, mask, C, comp_mask, share=True)
    assert not lora._share_failed
    _same(shared, plain)
    trainable = [p for p in lora.model.parameters() if p.requires_grad]
    assert 0 < len(plain[2]) == len(trainable) < len(list(lora.model.parameters()))  # the adapters only


def test_one_token_prompts_under_a_row_cap_run_plain_beside_shared_long_ones(trainer):
    """A memory cap on rows per forward (TRL's batch_size, as for old log-probs) with groups of a long prompt and of
    a one-token prompt: each bucket is one forward within the cap, and a bucket of one-token prompts (nothing to
    share) runs plain; it used to reach the shared forward and fail there."""
    rng = np.random.default_rng(6)
    ids, mask, C, comp_mask = _grouped_batch(trainer.processing_class, rng, prompt_lens=(100, 1),
                                             comp_lens=((5, 9, 3, 7, 4, 8, 6, 2), (5, 9, 3, 7, 4, 8, 6, 2)))
    model = trainer.model
    model.train()
    trainer.args.sage_bucket_overhead = 16
    trainer.args.sage_shared_prefix = True
    with torch.no_grad():
        calls, plain_forward = _spy(model)
        try:
            shared, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=8)
        finally:
            model.forward = plain_forward
    trainer.args.sage_shared_prefix = False
    with torch.no_grad():
        reference, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=8)
    torch.testing.assert_close(shared * comp_mask, reference * comp_mask, atol=1e-4, rtol=1e-4)
    assert max(n for n, *_ in calls) <= 8 and any(cached for _, _, cached, _ in calls)


def test_vision_language_models_do_not_share_prompts():
    """Qwen2.5-VL's text forward takes positions from rope_deltas that a generate call leaves behind, and with a
    cache it applies them to the chunk (seen in review: a crash): rows of a vision-language model run whole."""
    from transformers import Qwen2_5_VLConfig, Qwen2Config

    from sage_core.trainer import _multimodal

    def holder(config):
        m = torch.nn.Module()
        m.config = config
        return m

    assert _multimodal(holder(Qwen2_5_VLConfig()))
    assert not _multimodal(holder(Qwen2Config()))


@pytest.mark.parametrize("groups", [[0, 0, 0, 1, 1, 2], [2, 0, 1, 0, 2, 2, 2, 1], [0], [1, 1, 0]])
def test_a_prompts_cache_reaches_its_rows_with_the_sum_of_their_gradients(groups):
    """Each row reads its prompt's keys and values; the backward sums a prompt's row gradients."""
    g = torch.tensor(groups)
    t = torch.randn(int(g.max()) + 1, 2, 3, 4, requires_grad=True)
    rows = shared_prefix._replicator(g)(t)
    assert torch.equal(rows, t[g])
    upstream = torch.randn_like(rows)
    (grad,) = torch.autograd.grad(rows, t, upstream)
    torch.testing.assert_close(grad, torch.zeros_like(t).index_add_(0, g, upstream), rtol=1e-6, atol=1e-6)


def test_a_prompts_row_gradients_are_summed_in_the_same_order_every_time():
    """Plain `t[groups]` accumulates a prompt's row gradients with index_put, whose order PyTorch leaves open on
    CPU once a tensor is large enough to be split across threads (two identical resumed runs ended 1 ulp apart;
    20 backwards of this size differed here). The replicator's backward gives the same bits every time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        g = torch.randint(0, 4, (64,), generator=gen)
        g[:4] = torch.arange(4)
        t = torch.randn(4, 2, 64, 128, generator=gen, requires_grad=True)
        upstream = torch.randn(64, 2, 64, 128, generator=gen)
        grads = [torch.autograd.grad(shared_prefix._replicator(g)(t), t, upstream)[0] for _ in range(20)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0], x) for x in grads[1:])
    torch.testing.assert_close(grads[0], torch.zeros_like(t).index_add_(0, g, upstream), rtol=1e-5, atol=1e-5)
