"""Hint prefetch: the next step's new hint requests, decoded greedily in this step's rollout pass, are the policy's
greedy hints (their drafts), the next step checks them instead of decoding, and the prompts each step trains on do
not change."""

from __future__ import annotations

import glob

import pandas as pd
import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from sage_core.hint_prefetch import GreedyRows, Lookahead, StopRowsAt


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from sage_core.models import load_policy

    model, tok = load_policy(str(tiny_model_dir))
    model.eval()
    return model, tok


def _chat_ids(tok, chats):
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]


@pytest.mark.parametrize("limit", [40, 3])
def test_rows_after_a_sampled_batch_decode_greedily_and_stop_at_their_limit(policy, limit):
    from test_hint_drafts import _greedy, _requests

    model, tok = policy
    rollouts = _chat_ids(tok, [[{"role": "user", "content": f"What is {a} + {a} * 2?"}] for a in (3, 5)]) * 4
    hints = _requests(tok)
    batch = rollouts + hints
    width = max(map(len, batch))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.3, top_k=0, top_p=0.9,
                             max_new_tokens=40, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             logits_processor=LogitsProcessorList([GreedyRows(len(rollouts))]),
                             stopping_criteria=StoppingCriteriaList([StopRowsAt(len(rollouts), width, limit)]))
    new = out[:, width:].tolist()
    greedy = _greedy(model, tok, hints, limit)
    for row, want in zip(new[len(rollouts):], greedy, strict=True):
        assert row[:len(want)] == want  # the greedy hint, then padding (at an EOS or at the limit)
        assert all(t == tok.pad_token_id for t in row[len(want):])
    if limit == 3:
        assert all(len(g) <= 3 for g in greedy) and any(len(g) == 3 and tok.eos_token_id not in g for g in greedy)
        # the sampled rows went on past the hint rows' limit: the stop was theirs alone
        assert max(sum(t != tok.pad_token_id for t in r) for r in new[:len(rollouts)]) > limit
    # sampled rows stayed sampled: eight rows of two prompts wrote more than two completions
    assert len({tuple(r) for r in new[:len(rollouts)]}) > 2


def test_lookahead_gives_batches_in_order_and_finds_the_next_other_batch():
    batch = [{"prompt_id": "a"}, {"prompt_id": "b"}]
    other = [{"prompt_id": "c"}, {"prompt_id": "d"}]
    la = Lookahead(iter([batch, batch, other, other]))
    assert next(la) is batch
    la.fill(2)
    assert list(la.ahead) == [batch, other] and not la.ended
    assert la.next_other(["a", "b"]) is other  # the repeat of this generation batch is skipped
    assert la.next_other(["c", "d"]) is batch
    assert next(la) is batch and next(la) is other
    la.fill(5)
    assert la.ended and list(la.ahead) == [other] and la.next_other(["c", "d"]) == []
    assert next(la) is other
    with pytest.raises(StopIteration):
        next(la)


def _run(tmp_path, prefetch: bool, monkeypatch=None, record: dict | None = None, steps: int = 6, name: str = ""):
    import sage_core.train as train_module
    from sage_core.presets import preset

    out = tmp_path / (name or f"prefetch-{prefetch}")
    spec = preset("tiny-cpu", method="sage-light", num_prompts=16, max_steps=steps, save_steps=3,
                  hint_prefetch=prefetch)
    if record is None:
        res = train_module.train(spec, out, resume=bool(name))
    else:
        build = train_module.build_trainer

        def build_and_record(*args, **kwargs):
            trainer = build(*args, **kwargs)
            _record(trainer, record)
            return trainer

        with monkeypatch.context() as m:
            m.setattr(train_module, "build_trainer", build_and_record)
            res = train_module.train(spec, out, resume=False)
    rows = pd.concat([pd.read_parquet(f) for f in sorted(glob.glob(str(out / "tracker" / "*.parquet")))])
    rows = rows[["step", "prompt_id", "level", "hint_l1", "hint_l2", "hint_l3", "rewards"]].astype(str)
    steps = [h for h in res.log_history if "sage/frac_collapsed" in h]
    return rows, res.summary, sum(h.get("sage/hint_prefetch_rows", 0) for h in steps)


def _record(trainer, record):
    """Record, on the trainer's own methods: each step's prompts, the rows it read ahead as the next step's, each
    prefetched request's draft and the policy's greedy hint for it then, and each hint request sent to a decode loop."""
    from test_hint_drafts import _greedy

    sage_generate, prefetch, roll = trainer._sage_generate, trainer._prefetch_requests, trainer._roll
    single_turn, next_rows = trainer._generate_single_turn, trainer._next_rows
    record.update(steps=[], guesses={}, drafts=[], decoded=[], prefetched=[])

    def sage_generate_(prompts, rows):
        record["steps"].append([r["prompt_id"] for r in rows])
        return sage_generate(prompts, rows)

    def next_rows_(rows):
        nxt = next_rows(rows)
        record["guesses"][len(record["steps"])] = [r["prompt_id"] for r in nxt]
        return nxt

    def prefetch_(rows):
        out = prefetch(rows)
        record["prefetched"].append([tuple(p) for p in out])
        return out

    def single_turn_(prompt_ids, *args, **kwargs):
        extra = list(trainer._prefetch_ids)
        out = single_turn(prompt_ids, *args, **kwargs)
        if extra:
            model, tok = trainer.model, trainer.processing_class
            want = _greedy(model, tok, extra, trainer.args.hint_max_tokens)
            record["drafts"] += [(trainer._hint_drafts.get(p), w) for p, w in zip(extra, want, strict=True)]
        return out

    def roll_(prompts, kind="reroll"):
        if kind == "hint" and prompts:
            ids = trainer._tokenize_prompts(prompts)[0]
            drafts = trainer._hint_drafts
            checked = drafts.check(trainer.model, ids, trainer._max_new_tokens()) if drafts else [None] * len(ids)
            record["decoded"].append([(len(record["steps"]), tuple(p)) for p, c in zip(ids, checked, strict=True)
                                      if c is None or not c[1]])
        return roll(prompts, kind)

    trainer._sage_generate, trainer._prefetch_requests, trainer._next_rows = sage_generate_, prefetch_, next_rows_
    trainer._generate_single_turn, trainer._roll = single_turn_, roll_


def test_a_sage_light_run_prefetches_the_next_steps_hints_and_trains_the_same_prompts(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    rec: dict = {}
    rows, summary, prefetched = _run(tmp_path, True, monkeypatch, rec)
    plain_rows, plain, none = _run(tmp_path, False)
    steps = rec["steps"]
    # the rows read ahead were the next step's, within an epoch and across its end (16 prompts, 8 a step); the last
    # step reads the next too (the step a run resumed to more steps takes)
    assert set(rec["guesses"]) == set(range(1, len(steps) + 1))
    for step, guess in rec["guesses"].items():
        if step < len(steps):
            assert guess == steps[step], step
    # ... and reading them changed no step's prompts (the sampler's generator is put back after the peek)
    assert rows.groupby("step")["prompt_id"].apply(sorted).tolist() == \
        plain_rows.groupby("step")["prompt_id"].apply(sorted).tolist()
    # each prefetched row wrote the greedy hint of the policy of its pass
    assert len(rec["drafts"]) == prefetched > 0 and none == 0
    for draft, greedy in rec["drafts"]:
        assert draft == greedy
    # a prefetched request the next step asked needed no decode loop there
    asked_after = {(k + 2, p) for k, ps in enumerate(rec["prefetched"]) for p in ps}
    decoded = {d for ds in rec["decoded"] for d in ds}
    assert not asked_after & decoded
    assert summary["hint_passes"] < plain["hint_passes"]
    # a run stopped at step 3 and resumed to 6 rolls out what the straight run did (which rows join a pass depends
    # on what a checkpoint keeps, not on the drafts it does not keep, nor on max_steps)
    _run(tmp_path, True, steps=3, name="resumed")
    resumed, _, _ = _run(tmp_path, True, steps=6, name="resumed")
    pd.testing.assert_frame_equal(resumed.reset_index(drop=True), rows.reset_index(drop=True))


def test_prefetch_is_off_where_its_drafts_would_not_be_the_hints(tiny_model_dir, tmp_path):
    from sage_core.hints import CachedHints
    from sage_core.presets import preset
    from sage_core.schedulers import make_scheduler
    from sage_core.train import build_trainer

    trainer = build_trainer(preset("tiny-cpu", method="sage-light", num_prompts=8, prompts_per_step=2, max_steps=1,
                                   hint_prefetch=True), tmp_path)
    a, online, light = trainer.args, trainer.hint_source, trainer.scheduler
    assert trainer._prefetch_wanted()
    for name, value in (("sage_hint_prefetch", False), ("sage_hint_drafts", False), ("hint_temperature", 0.7)):
        setattr(a, name, value)  # off (the default), no drafts, sampled hints (no draft is the hint)
        assert not trainer._prefetch_wanted(), name
        setattr(a, name, type(value)(not value) if isinstance(value, bool) else 0.0)
        assert trainer._prefetch_wanted()
    trainer.hint_source = CachedHints({})  # fixed or teacher hints: not written by the policy at each step
    assert not trainer._prefetch_wanted()
    trainer.hint_source, trainer.scheduler = online, make_scheduler("grpo")
    assert not trainer._prefetch_wanted()
    trainer.scheduler = light
    with trainer._sampling(8, 1.0):
        assert trainer._greedy_hint_drafts(sampled=True) is not None  # a rollout pass's greedy rows
        trainer.generation_config.repetition_penalty = 1.2  # changes greedy's choice: no greedy rows
        assert trainer._greedy_hint_drafts(sampled=True) is None
