"""HF generate's cache for groups: each distinct prompt prefilled once, keys appended in place; the same rollouts."""

from __future__ import annotations

import functools
import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.cache_utils import DynamicLayer

from sage_core import shared_prefix
from sage_core.generation_cache import AppendLayer, generation_cache
from sage_core.tracker import read_tracker


# ---------------------------------------------------------------------------------------------- AppendLayer
def _apply(layer, op, arg):
    if op == "update":
        return layer.update(*arg)
    if op == "crop":
        layer.crop(arg)
    elif op == "select":
        layer.batch_select_indices(arg)
    elif op == "reorder":
        layer.reorder_cache(arg)
    elif op == "repeat":
        layer.batch_repeat_interleave(arg)
    elif op == "reset":
        layer.reset()


@pytest.mark.parametrize("seed", range(6))
def test_an_append_layer_holds_what_a_dynamic_layer_holds_through_any_cache_operation(seed):
    """Updates of one or many positions, crops, row selection, beam reordering, repeats and resets in random order:
    after each, the keys and values (and what update returns) equal DynamicLayer's exactly, whatever the room."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    dyn, app = DynamicLayer(), AppendLayer(limit=rng.choice([None, 1, 6, 40]))
    B, H, D = 4, 2, 3
    for _ in range(60):
        t = dyn.get_seq_length()
        op = rng.choice(["update"] * 5 + ["crop", "select", "reorder", "repeat", "reset"])
        if op == "update":  # now and then in another dtype (autocast): both then hold the promoted one
            n = rng.choice([1, 1, 1, 5])
            kd, vd = (rng.choice([torch.float32] * 3 + [torch.bfloat16]) for _ in range(2))
            arg = (torch.randn(B, H, n, D, generator=gen).to(kd), torch.randn(B, H, n, D, generator=gen).to(vd))
        elif op == "crop":
            if t < 2:
                continue
            arg = -rng.randint(1, t - 1)
        elif op == "select":  # some rows, in any order
            if t == 0:
                continue
            arg = torch.tensor(rng.sample(range(B), k=rng.randint(1, B)))
            B = len(arg)
        elif op == "reorder":
            if t == 0:
                continue
            arg = torch.tensor(rng.sample(range(B), k=B))
        elif op == "repeat":
            if t == 0 or B > 8:
                continue
            arg = 2
            B *= 2
        else:
            arg = None
        a, b = _apply(dyn, op, arg), _apply(app, op, arg)
        if op == "update":
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert app.get_seq_length() == dyn.get_seq_length()
        if dyn.get_seq_length():
            assert app.keys.dtype == dyn.keys.dtype and app.values.dtype == dyn.values.dtype
            assert torch.equal(app.keys, dyn.keys) and torch.equal(app.values, dyn.values)


def _buffers(layer, steps):
    """The distinct buffers a layer wrote into over `steps` one-position updates, and its last buffer's size."""
    seen = set()
    for _ in range(steps):
        layer.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
        seen.add(layer.keys.data_ptr())
    return len(seen), layer._buf[0].shape[-2]


def test_decode_steps_write_in_place_into_a_buffer_that_doubles_up_to_the_expected_length():
    layer = AppendLayer(limit=5 + 40)  # a 5-token prompt, 40 new tokens expected
    layer.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))
    assert layer._buf[0].shape[-2] == 21  # 5 + 16: room to start with, not the whole completion's
    assert _buffers(layer, 40) == (2, 45)  # grown once, to the expected length; no copy per step
    assert layer.get_seq_length() == 45
    assert _buffers(layer, 1) == (1, 92)  # past it: doubling again
    long = AppendLayer(limit=100 + 8000)  # a long completion: buffers double, so the copies stay linear
    long.update(torch.randn(2, 1, 100, 4), torch.randn(2, 1, 100, 4))
    n, size = _buffers(long, 1000)
    assert n == 4 and size == 1614 and long.get_seq_length() == 1100  # 200, 402, 806, 1614: not 8100 at once


# ---------------------------------------------------------------------------------------------- with generate
@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _groups(G=8, lens=(9, 23, 31), seed=0, shuffle=False):
    """Left-padded prompts of different lengths, each repeated G times in a row (TRL's rollout layout), or with the
    rows in a random order (a prompt's rows apart)."""
    gen = torch.Generator().manual_seed(seed)
    P = max(lens)
    ids, mask = torch.zeros(len(lens), P, dtype=torch.long), torch.zeros(len(lens), P, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, P - n:] = torch.randint(5, 400, (n,), generator=gen)
        mask[i, P - n:] = 1
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    if shuffle:
        order = torch.randperm(ids.size(0), generator=gen)
        ids, mask = ids[order], mask[order]
    return ids, mask


def _generate(model, ids, mask, conf, cache=None, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        kw = {} if cache is None else {shared_prefix.cache_kwarg(model): cache}
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=conf, output_scores=True,
                              return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("sample,positions,shuffle", [(False, True, False), (True, True, False),
                                                      (False, False, False), (True, True, True)])
def test_generate_with_the_groups_cache_writes_the_same_rollouts(model, sample, positions, shuffle):
    """Greedy and sampled (same seed), with a forward that takes position_ids and one that does not, a prompt's
    rows together or apart: the same tokens as generate's own prefill, and every step's scores equal within float
    rounding; the prompt's last token is the only one generate still prefills."""
    ids, mask = _groups(shuffle=shuffle)
    conf = GenerationConfig(max_new_tokens=24, do_sample=sample, temperature=1.0, pad_token_id=0, eos_token_id=1)
    plain = _generate(model, ids, mask, conf)
    calls, forward = [], model.forward

    def spy(*a, **k):
        calls.append(tuple(k["input_ids"].shape))
        return forward(*a, **k)

    # generate passes position_ids (the mask's running count) only to a forward that names them; the cache follows
    model.forward = functools.wraps(forward)(spy) if positions else spy
    try:
        cache = generation_cache(model, ids, mask, conf.max_new_tokens)
        shared = _generate(model, ids, mask, conf, cache)
    finally:
        del model.forward
    assert calls[0] == (3, ids.size(1) - 1)  # three distinct prompts, prefilled once each, minus the last token
    assert calls[1] == (ids.size(0), 1)  # generate's prefill: each row's last prompt token only
    assert all(shape == (ids.size(0), 1) for shape in calls[2:])
    assert torch.equal(plain.sequences, shared.sequences)
    assert len(plain.scores) == len(shared.scores) > 1
    for a, b in zip(plain.scores, shared.scores, strict=True):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        torch.testing.assert_close(a[finite], b[finite], atol=1e-4, rtol=1e-4)
    assert all(isinstance(layer, AppendLayer) for layer in cache.layers)


def test_a_batch_without_repeated_prompts_gets_no_cache(model):
    ids, mask = _groups(G=1)
    assert generation_cache(model, ids, mask, 8) is None
    one = torch.tensor([[5], [5]])
    assert generation_cache(model, one, torch.ones_like(one), 8) is None  # nothing to prefill before the last token


def test_a_cache_that_is_not_full_attention_is_refused(model, monkeypatch):
    ids, mask = _groups(G=2)
    monkeypatch.setattr(shared_prefix, "DynamicLayer", type("SlidingLayer", (), {}))
    with pytest.raises(shared_prefix.CacheUnsupported, match="DynamicLayer"):
        generation_cache(model, ids, mask, 8)


# ---------------------------------------------------------------------------------------------- in the trainer
def _trainer(tmp_path, **kw):
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    spec = preset("tiny-cpu", **{"method": "sage", "num_prompts": 8, "prompts_per_step": 4, "max_steps": 2, **kw})
    return build_trainer(spec, tmp_path)


def _spied(trainer):
    """Each generate call the trainer makes: (rows, whether it was handed a cache)."""
    calls, model = [], trainer.model
    cls_generate = type(model).generate

    def spy(self, *a, **k):
        calls.append((k["input_ids"].size(0), any(n in k for n in ("cache", "past_key_values"))))
        return cls_generate(self, *a, **k)

    return calls, spy


def test_the_trainer_hands_generate_the_groups_cache_and_trains_the_same(tiny_model_dir, tmp_path, monkeypatch):
    """SAGE for two steps with and without shared_prefill: every rollout call of G-row groups gets the cache (hint
    calls, one row per request, do not), the instance's generate is restored after each call, and the runs roll out,
    score and hint alike and reach the same weights up to float rounding."""
    runs = {}
    for share in (True, False):
        trainer = _trainer(tmp_path / str(share), shared_prefill=share)
        calls, spy = _spied(trainer)
        monkeypatch.setattr(type(trainer.model), "generate", spy)
        torch.manual_seed(0)
        trainer.train()
        monkeypatch.undo()
        assert "generate" not in vars(trainer.model)
        runs[share] = (calls, read_tracker(trainer.args.tracker_dir), trainer.model.state_dict())
    (calls, df, w), (plain_calls, plain_df, plain_w) = runs[True], runs[False]
    rollouts = [c for c in calls if c[0] % 8 == 0 and c[0] >= 8]
    assert rollouts and all(cached for _, cached in rollouts)
    assert not any(cached for _, cached in plain_calls)
    assert [n for n, _ in calls] == [n for n, _ in plain_calls]  # the same calls, the same widths
    cols = ["step", "prompt_id", "level", "pass_rate", "hint"]
    assert df[cols].equals(plain_df[cols])
    assert (df.level > 0).any()  # hinted re-rolls were part of it
    for k, v in plain_w.items():
        torch.testing.assert_close(w[k], v, atol=1e-5, rtol=1e-4)


def test_a_model_whose_cache_cannot_be_shared_generates_plain_once_warned(tiny_model_dir, tmp_path, monkeypatch,
                                                                            caplog):
    trainer = _trainer(tmp_path, max_steps=1)
    monkeypatch.setattr(shared_prefix, "DynamicLayer", type("SlidingLayer", (), {}))
    calls, spy = _spied(trainer)
    monkeypatch.setattr(type(trainer.model), "generate", spy)
    with caplog.at_level(logging.WARNING, logger="sage_core.trainer"):
        trainer.train()
    assert trainer._prefill_failed
    assert caplog.text.count("generate prefills every row") == 1 and "DynamicLayer" in caplog.text
    assert calls and not any(cached for _, cached in calls)


def test_lora_adapters_are_in_the_groups_prefill(tiny_model_dir, tmp_path):
    """A PEFT model (as `lora_r` builds it) with adapters that change its outputs: the cache is prefilled through the
    adapters and reaches the base model's generate, so the rollouts are the PEFT model's own."""
    trainer = _trainer(tmp_path, lora_r=4, lora_alpha=8, max_steps=1)
    model = trainer.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.eval()
    ids, mask = _groups(G=4)
    conf = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.0, pad_token_id=0, eos_token_id=1)
    plain = _generate(model, ids, mask, conf)
    shared = _generate(model, ids, mask, conf, generation_cache(model, ids, mask, conf.max_new_tokens))
    assert torch.equal(plain.sequences, shared.sequences)
    with model.disable_adapter():
        base = _generate(model, ids, mask, conf)
    assert not torch.equal(base.sequences, plain.sequences)  # the adapters matter to these rollouts


def test_lora_under_bf16_autocast_trains_with_the_groups_cache(tiny_model_dir, tmp_path, monkeypatch):
    """accelerate wraps the PEFT model's forward in autocast, while generate runs the base model's forward: the
    prefill runs the base model's too, so the cache holds what generate's steps append (seen: bf16 values beside
    fp32 ones, and SDPA refusing the mix). One GRPO step with LoRA in bf16 rolls out with the cache."""
    trainer = _trainer(tmp_path, method="grpo", lora_r=4, lora_alpha=8, bf16=True, max_steps=1)
    assert trainer.args.bf16
    calls, spy = _spied(trainer)
    monkeypatch.setattr(type(trainer.model), "generate", spy)  # PEFT's generate, which calls the base model's
    trainer.train()
    assert calls and all(cached for _, cached in calls) and not trainer._prefill_failed


@pytest.mark.parametrize("field,value", [("num_beams", 2), ("num_return_sequences", 2),
                                         ("cache_implementation", "static")])
def test_the_models_own_generation_config_can_rule_the_cache_out(tiny_model_dir, tmp_path, field, value):
    """generate takes what TRL's config leaves unset from the model's generation_config (a checkpoint's
    generation_config.json): beams, several sequences per row or a cache implementation of its own there leave
    generate as it is (with the cache, beams would expand the rows and not the cache)."""
    trainer = _trainer(tmp_path, max_steps=1)
    model = trainer.model
    with trainer._shared_prefill(False):
        assert "generate" in vars(model)  # wrapped, by default
    assert "generate" not in vars(model)
    setattr(model.generation_config, field, value)
    with trainer._shared_prefill(False):
        assert "generate" not in vars(model)
