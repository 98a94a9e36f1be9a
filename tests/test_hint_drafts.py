"""Hint drafts: a greedy hint checked in one forward against the request's last hint is the hint greedy decoding
writes, and a run with drafts writes the same hints with fewer decode loops."""

from __future__ import annotations

import glob
from pathlib import Path

import pandas as pd
import pytest
import torch

from sage_core.hint_drafts import HintDrafts


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from sage_core.models import load_policy

    model, tok = load_policy(str(tiny_model_dir))
    model.eval()
    return model, tok


def _greedy(model, tok, prompts, max_new):
    """Greedy hints as HF generate writes them (left-padded batch, on the model's device), cut after the first EOS."""
    width, device = max(map(len, prompts)), next(model.parameters()).device
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, width:].tolist()
    return [o[:o.index(tok.eos_token_id) + 1] if tok.eos_token_id in o else o for o in out]


def _requests(tok):
    from sage_core.hints import HintRequest, request_prompt

    reqs = [HintRequest("a", "What is 3 + 4 * 2?", "4 * 2 = 8, 3 + 8 = 11", "11", 1),
            HintRequest("b", "What is 9 - 2 - 3?", "9 - 2 = 7, 7 - 3 = 4", "4", 3),
            HintRequest("c", "What is 6 * 3 + 1?", "6 * 3 = 18, 18 + 1 = 19", "19", 2)]
    return [tok.apply_chat_template(request_prompt(r), add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for r in reqs]


def test_a_draft_greedy_decoding_writes_again_is_the_hint(policy):
    model, tok = policy
    prompts = _requests(tok)
    hints = _greedy(model, tok, prompts, 24)
    drafts = HintDrafts([tok.eos_token_id], tok.pad_token_id)
    assert drafts.check(model, prompts, 24) == [None] * 3  # nothing written yet
    for p, h in zip(prompts, hints, strict=True):
        drafts.remember(p, h)
    for (tokens, done), h in zip(drafts.check(model, prompts, 24), hints, strict=True):
        assert tokens == h and done


def test_a_wrong_draft_keeps_its_matching_prefix_and_greedys_next_token(policy):
    model, tok = policy
    requests = _requests(tok)
    # the request with the longest greedy hint (which one that is depends on the tiny model's build)
    hint, prompt = max(zip(_greedy(model, tok, requests, 24), requests, strict=True), key=lambda hp: len(hp[0]))
    prompts = [prompt]
    assert len(hint) > 4
    drafts = HintDrafts([tok.eos_token_id], tok.pad_token_id)
    wrong = hint[:3] + [(hint[3] + 1) % len(tok)] + hint[4:]
    drafts.remember(prompts[0], wrong)
    ((tokens, done),) = drafts.check(model, prompts, 24)
    assert tokens == hint[:4] and done == (hint[3] == tok.eos_token_id)
    # a draft cut short (an earlier, shorter limit) is matched and extended by one greedy token
    drafts.remember(prompts[0], hint[:2])
    ((tokens, done),) = drafts.check(model, prompts, 24)
    assert tokens == hint[:3] and not done
    # a limit below the draft's length: the hint is cut there, as generate would cut it
    drafts.remember(prompts[0], hint)
    ((tokens, done),) = drafts.check(model, prompts, 2)
    assert tokens == hint[:2] and done


def _run(tmp_path: Path, method: str, drafts: bool, **kw):
    from sage_core.presets import preset
    from sage_core.train import train

    out = tmp_path / f"{method}-{drafts}"
    res = train(preset("tiny-cpu", method=method, num_prompts=16, max_steps=5, hint_drafts=drafts, **kw), out,
                resume=False)
    rows = pd.concat([pd.read_parquet(f) for f in sorted(glob.glob(str(out / "tracker" / "*.parquet")))])
    return rows[["prompt_id", "level", "hint_l1", "hint_l2", "hint_l3", "rewards"]].astype(str), res.summary


def test_a_sage_run_with_drafts_writes_the_same_hints_with_fewer_decode_loops(tiny_model_dir, tmp_path):
    plain, s0 = _run(tmp_path, "sage", drafts=False)
    drafted, s1 = _run(tmp_path, "sage", drafts=True)
    pd.testing.assert_frame_equal(drafted, plain)  # the same hints, rewards and levels, step by step
    assert s1["never_solved"] == s0["never_solved"] and s1["rollouts"] == s0["rollouts"]
    assert s1["hint_passes"] < s0["hint_passes"]


def test_sampled_hints_and_dropout_take_no_draft(tiny_model_dir, tmp_path):
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    trainer = build_trainer(preset("tiny-cpu", method="sage", num_prompts=8, prompts_per_step=2, max_steps=1),
                            tmp_path)
    with trainer._sampling(8, 0.0):
        assert isinstance(trainer._greedy_hint_drafts(), HintDrafts)
    with trainer._sampling(8, 1.0):
        assert trainer._greedy_hint_drafts() is None
    trainer.model.train()
    trainer.model.config.attention_dropout = 0.1  # greedy decoding in training mode is then random
    with trainer._sampling(8, 0.0):
        assert trainer._greedy_hint_drafts() is None
        trainer.model.eval()
        assert isinstance(trainer._greedy_hint_drafts(), HintDrafts)
    trainer.model.train()
    trainer.model.config.attention_dropout = 0.0
    trainer.args.sage_hint_drafts = False
    with trainer._sampling(8, 0.0):
        assert trainer._greedy_hint_drafts() is None


def test_drafts_check_at_the_positions_generate_uses_with_absolute_position_embeddings():
    """GPT-2-style models read each token's position: a left-padded row's first token is position 0 in generate,
    and the check must number it so too (with positions 0..width-1, a correct draft was rejected and a wrong token
    became part of the hint)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    vocab, eos, pad = 64, 1, 0
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=128, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
                                       initializer_range=0.5)).eval()
    prompts = [list(range(2, 30)), list(range(5, 13))]  # the second is left-padded by 20
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (ids != pad).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                             pad_token_id=pad, eos_token_id=[eos])[:, width:].tolist()
    hints = [o[:o.index(eos) + 1] if eos in o else o for o in out]
    drafts = HintDrafts([eos], pad)
    for p, h in zip(prompts, hints, strict=True):
        drafts.remember(p, h)
    assert [c[0] for c in drafts.check(model, prompts, 12)] == hints


def test_settings_that_change_greedys_choice_turn_drafts_off():
    """TRL's generation config leaves most logits processors unset, and generate fills them from the model's own:
    a model whose generation_config.json sets min_new_tokens or no_repeat_ngram_size decodes something else than
    the argmax, so no draft is checked for it. Dropout in training mode (a Dropout module or a config rate) too."""
    from transformers import GenerationConfig

    from sage_core.trainer import _argmax_changed, _dropout_active

    trl = GenerationConfig(max_new_tokens=8, do_sample=False, repetition_penalty=1.0)
    assert not _argmax_changed(trl, GenerationConfig())
    for field, value in (("min_new_tokens", 20), ("no_repeat_ngram_size", 2), ("num_beams", 2),
                         ("suppress_tokens", [5]), ("forced_eos_token_id", 1)):
        assert _argmax_changed(trl, GenerationConfig(**{field: value})), field
    assert _argmax_changed(GenerationConfig(repetition_penalty=1.1), GenerationConfig())
    assert not _argmax_changed(trl, GenerationConfig(repetition_penalty=1.3))  # TRL's own value wins

    class Block(torch.nn.Module):
        def __init__(self, **config):
            super().__init__()
            self.config = GenerationConfig()
            for k, v in config.items():
                setattr(self.config, k, v)
            self.linear = torch.nn.Linear(2, 2)

    for config in ({"hidden_dropout": 0.3}, {"resid_pdrop": 0.1}, {"router_jitter_noise": 0.5}):
        block = Block(**config).train()
        assert _dropout_active(block) and not _dropout_active(block.eval()), config
    assert not _dropout_active(Block(attention_dropout=0.0).train())
    assert _dropout_active(torch.nn.Sequential(torch.nn.Dropout(0.1)).train())
