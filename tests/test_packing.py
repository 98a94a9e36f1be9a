"""Length buckets for the loss's forward: an optimal split, and a forward that gives the loss the same tensors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_core.packing import length_buckets, padded_area

lengths = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=9)


def cost(p, c, buckets, overhead):
    return padded_area(p, c, buckets) + overhead * len(buckets)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(0, 300))
def test_buckets_partition_the_rows_and_beat_every_contiguous_split(rows, overhead):
    p, c = [r[0] for r in rows], [r[1] for r in rows]
    buckets = length_buckets(p, c, overhead)
    assert sorted(i for b in buckets for i in b) == list(range(len(rows)))
    assert cost(p, c, buckets, overhead) <= cost(p, c, [list(range(len(rows)))], overhead)
    # exhaustive: every way to cut the rows sorted by total length into contiguous runs
    order = sorted(range(len(rows)), key=lambda i: -(p[i] + c[i]))
    best = min(
        cost(p, c, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(rows)), strict=True)], overhead)
        for k in range(len(rows))
        for cuts in itertools.combinations(range(1, len(rows)), k)
    )
    assert cost(p, c, buckets, overhead) == best


def test_buckets_split_a_few_long_rows_from_many_short_ones():
    p, c = [25] * 56 + [55] * 8, [18] * 56 + [38] * 8  # 7 bare groups and one hinted group with long completions
    buckets = length_buckets(p, c, overhead=256)
    assert sorted(map(len, buckets)) == [8, 56]
    assert padded_area(p, c, buckets) == 8 * 93 + 56 * 43 < padded_area(p, c) == 64 * 93
    assert length_buckets(p, c, overhead=10**9) == [sorted(range(64), key=lambda i: -(p[i] + c[i]))]


def test_bad_lengths_are_named():
    with pytest.raises(ValueError, match="1-D of one length"):
        length_buckets([1, 2], [1])
    with pytest.raises(ValueError, match="overhead"):
        length_buckets([1], [1], overhead=-1)
    assert length_buckets([], []) == []


def _padded_batch(tok, rng):
    """Left-padded prompts and right-padded completions of varied lengths, as TRL lays them out."""
    prompts = [rng.integers(5, 400, n).tolist() for n in (25, 25, 31, 55, 55, 40)]
    comps = [rng.integers(5, 400, n).tolist() for n in (18, 3, 18, 38, 30, 0)]
    P, C = max(map(len, prompts)), max(map(len, comps))
    ids = torch.full((len(prompts), P + C), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        ids[i, P - len(p):P], mask[i, P - len(p):P] = torch.tensor(p), 1
        if c:
            ids[i, P:P + len(c)], mask[i, P:P + len(c)] = torch.tensor(c), 1
    return ids, mask, C, mask[:, P:]


def test_bucketed_forward_gives_the_loss_the_same_logps_entropies_and_gradients(tiny_model_dir, tmp_path):
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    trainer = build_trainer(preset("tiny-cpu", method="grpo", num_prompts=8, prompts_per_step=2, max_steps=1),
                            tmp_path)
    ids, mask, C, comp_mask = _padded_batch(trainer.processing_class, np.random.default_rng(0))
    assert trainer.args.sage_bucket_overhead == 256  # the CPU default
    model = trainer.model
    calls = []
    plain_forward = model.forward

    def counting_forward(*a, **k):
        calls.append(k["input_ids"].shape)
        return plain_forward(*a, **k)

    model.forward = counting_forward
    results = {}
    for buckets in (False, True):
        trainer.args.sage_length_buckets, trainer.args.sage_bucket_overhead = buckets, 16
        model.zero_grad()
        calls.clear()
        logps, ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, compute_entropy=True)
        (logps * comp_mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results[buckets] = (logps * comp_mask, ent * comp_mask, grads, list(calls))
    (lp0, ent0, g0, calls0), (lp1, ent1, g1, calls1) = results[False], results[True]
    assert lp1.shape == lp0.shape == (6, C)
    torch.testing.assert_close(lp1, lp0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent1, ent0, atol=1e-4, rtol=1e-4)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    # one padded forward before; buckets after, each no wider than its own longest prompt + completion
    assert calls0 == [ids.shape] and len(calls1) > 1
    assert sum(s[0] * s[1] for s in calls1) < ids.shape[0] * ids.shape[1]


def test_absolute_position_embeddings_keep_each_rows_positions_in_a_bucket(tiny_model_dir, tmp_path):
    """GPT-2-style models add a learned embedding of each column's index, and TRL's forward numbers a left-padded
    row's columns from 0 with its padding: a bucket trimmed of shared left padding moved every row's tokens to
    other positions (log-probs about 0.25 nats off TRL's, gradients off by more than their size)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl.trainer.utils import add_fused_lm_head

    from sage_core.presets import preset
    from sage_core.train import build_trainer

    trainer = build_trainer(preset("tiny-cpu", method="grpo", num_prompts=8, prompts_per_step=2, max_steps=1),
                            tmp_path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=400, n_positions=256, n_embd=64, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model.train()
    ids, mask, C, comp_mask = _padded_batch(trainer.processing_class, np.random.default_rng(0))
    ids = ids.masked_fill(mask == 0, 0)  # the tokenizer's pad id is outside this vocabulary
    trainer.args.sage_bucket_overhead = 0
    results = []
    for buckets, share in ((False, False), (True, False), (True, True)):
        trainer.args.sage_length_buckets, trainer.args.sage_shared_prefix = buckets, share
        model.zero_grad()
        logps, ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, compute_entropy=True)
        (logps * comp_mask).sum().backward()
        results.append((logps * comp_mask, ent * comp_mask, [p.grad.clone() for p in model.parameters()]))
    for lp, ent, grads in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ent, results[0][1], atol=1e-4, rtol=1e-4)
        for a, b in zip(grads, results[0][2], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_with_sharded_parameters_the_loss_runs_trls_forwards_on_every_rank(tiny_model_dir, tmp_path):
    """ZeRO-3/FSDP gather parameters in every forward, collectively: a rank whose rows split into one bucket more
    than another's would hang. With sharded parameters the forward is TRL's own loop (batch_size rows at a time),
    the same count on every rank, whatever the rows' lengths and advantages."""
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    trainer = build_trainer(preset("tiny-cpu", method="grpo", num_prompts=8, prompts_per_step=2, max_steps=1),
                            tmp_path)
    assert trainer._sharded is False  # one CPU process
    ids, mask, C, _ = _padded_batch(trainer.processing_class, np.random.default_rng(0))
    model, calls, plain_forward = trainer.model, [], trainer.model.forward
    model.forward = lambda *a, **k: calls.append(k["input_ids"].shape) or plain_forward(*a, **k)
    trainer.args.sage_bucket_overhead = 16
    trainer._no_grad_rows = torch.tensor([True, False, True, False, True, False])
    trainer._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=4)
    assert len(calls) > 2  # unsharded: buckets by length and by advantage
    calls.clear()
    trainer._sharded = True
    trainer._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=4)
    assert calls == [(4, ids.size(1)), (2, ids.size(1))]  # TRL's loop: rows 0-3, then 4-5, full width


def test_zero_advantage_rows_skip_their_backward_and_the_loss_gradient_is_unchanged(tiny_model_dir, tmp_path):
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    trainer = build_trainer(preset("tiny-cpu", method="grpo", num_prompts=8, prompts_per_step=2, max_steps=1),
                            tmp_path)
    ids, mask, C, comp_mask = _padded_batch(trainer.processing_class, np.random.default_rng(1))
    P = ids.size(1) - C
    inputs = {"prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P], "completion_ids": ids[:, P:],
              "completion_mask": comp_mask, "advantages": torch.tensor([0.0, 0.0, 1.2, -0.7, 0.0, 0.0]),
              "num_items_in_batch": comp_mask.sum().float()}
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() for each optimizer step
    grad_modes = []
    plain_forward = model.forward

    def spy(*a, **k):
        grad_modes.append((k["input_ids"].size(0), torch.is_grad_enabled()))
        return plain_forward(*a, **k)

    model.forward = spy
    out = {}
    for skip in (False, True):
        trainer.args.sage_skip_zero_advantage = skip
        trainer._metrics["train"].clear()
        model.zero_grad()
        grad_modes.clear()
        loss = trainer._compute_loss(model, dict(inputs))
        loss.backward()
        out[skip] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None],
                     trainer._metrics["train"]["entropy"][-1], list(grad_modes))
    (l0, g0, e0, m0), (l1, g1, e1, m1) = out[False], out[True]
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-4)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
    assert e1 == pytest.approx(e0, rel=1e-4)  # the logged entropy still covers every row
    assert all(grad for _, grad in m0)
    assert sum(n for n, grad in m1 if grad) == 2 and sum(n for n, grad in m1 if not grad) == 4
    # all rows dead (every group collapsed): one bucket keeps the loss on the graph, with a zero gradient
    model.zero_grad()
    loss = trainer._compute_loss(model, {**inputs, "advantages": torch.zeros(6)})
    loss.backward()
    assert all(float(p.grad.abs().max()) == 0 for p in model.parameters() if p.grad is not None)
