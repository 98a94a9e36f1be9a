"""The trainer on a CUDA GPU (skipped without one). The CPU tests cover the logic; these check what a GPU changes:
the device the policy trains on, bfloat16 autocast in the loss's forward (generation stays float32, as in TRL),
CUDA's attention kernels under a shared prompt's cache, and greedy hint drafts checked by CUDA's kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import metric

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train_hard_sage(tmp_path):
    """SAGE on hard prompts with teacher hints from the reference solutions, the loss's prompts recorded."""
    from test_trainer import small

    from sage_core.data import build_dataset
    from sage_core.hints import write_reference_hints
    from sage_core.train import build_trainer

    # the spec of test_trainer's sage_hard (its small SAGE setting on hard prompts)
    spec = small("sage", difficulty="hard", max_steps=3, hint_source="teacher", teacher=str(tmp_path / "teacher.jsonl"))
    write_reference_hints(list(build_dataset(spec)), tmp_path / "teacher.jsonl")
    trainer = build_trainer(spec, tmp_path)
    start = {k: v.detach().float().cpu().clone() for k, v in trainer.model.state_dict().items()}
    seen, original = [], trainer._compute_loss

    def spy(model, inputs):
        seen.append((inputs["prompt_ids"].device.type, trainer.processing_class.batch_decode(
            inputs["prompt_ids"], skip_special_tokens=True)))
        return original(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    return trainer, start, seen


def test_sage_trains_on_the_gpu_with_bf16_autocast_and_hinted_prompts(tiny_model_dir, tmp_path):
    from sage_core.prompts import HINT_HEADER
    from sage_core.tracker import read_tracker

    trainer, start, seen = _train_hard_sage(tmp_path)
    assert trainer.args.bf16 and trainer.accelerator.device.type == "cuda"
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert next(trainer.model.parameters()).dtype == torch.float32  # float32 master weights, bf16 compute
    losses = metric(trainer, "loss")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    df = read_tracker(tmp_path / "tracker")
    all0 = df[df.base_state == "all0"]
    assert len(all0) > 0 and (all0.max_level_tried >= 1).all()
    # the loss saw, on the GPU, the hinted prompt exactly for the rows of hinted groups
    assert all(dev == "cuda" for dev, _ in seen)
    hinted_rows = [sum(HINT_HEADER in p for p in batch) for _, batch in seen]
    assert hinted_rows == [8 * int((df[df.step == s].level > 0).sum()) for s in (1, 2, 3)] and sum(hinted_rows) > 0
    end = trainer.model.state_dict()
    moved = max(float((end[k].float().cpu() - v).abs().max()) for k, v in start.items())
    assert moved > 0 and all(torch.isfinite(v).all() for v in end.values())


@pytest.fixture(scope="module")
def gpu_trainer(tiny_model_dir, tmp_path_factory):
    from sage_core.presets import preset
    from sage_core.train import build_trainer

    return build_trainer(preset("tiny-cpu", method="grpo", num_prompts=8, prompts_per_step=2, max_steps=1),
                         tmp_path_factory.mktemp("gpu_shared"))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_shared_prompts_match_the_plain_forward_on_the_gpu(gpu_trainer, bf16):
    """The shared forward (prompt once into a DynamicCache, completions against it) gives the loss what the plain
    forward gives, with CUDA's attention kernels; under bf16 autocast up to bf16's rounding."""
    from test_shared_prefix import _grouped_batch, _run, _spy

    trainer = gpu_trainer
    assert trainer.accelerator.mixed_precision == "bf16"  # what training on a GPU autocasts to (bf16=None: on)
    device = trainer.accelerator.device
    ids, mask, C, comp_mask = (t.to(device) if torch.is_tensor(t) else t for t in
                               _grouped_batch(trainer.processing_class, np.random.default_rng(0)))
    trainer.model.train()
    trainer.args.sage_bucket_overhead = 16
    # accelerate's autocast() reads native_amp on each call (this model was never prepared, so its forward carries
    # no autocast wrapper of its own): off here is float32, on is the loss's bf16 autocast
    amp = trainer.accelerator.native_amp
    trainer.accelerator.native_amp = bf16
    calls, plain_forward = _spy(trainer.model)
    try:
        plain = _run(trainer, ids, mask, C, comp_mask, share=False)
        shared = _run(trainer, ids, mask, C, comp_mask, share=True)
    finally:
        trainer.accelerator.native_amp = amp
        trainer.model.forward = plain_forward
    assert not trainer._share_failed and any(cached for *_, cached, _ in calls)  # rows ran against a prompt cache
    tol = 5e-2 if bf16 else 1e-3
    torch.testing.assert_close(shared[0], plain[0], atol=tol, rtol=tol)
    torch.testing.assert_close(shared[1], plain[1], atol=tol, rtol=tol)
    g_plain = torch.cat([g.flatten() for g in plain[2]])
    g_shared = torch.cat([g.flatten() for g in shared[2]])
    cos = float(torch.nn.functional.cosine_similarity(g_plain, g_shared, dim=0))
    assert cos > (0.99 if bf16 else 0.99999), cos
    if bf16:  # autocast really ran in bfloat16: its log-probs are not the float32 ones
        trainer.accelerator.native_amp = False
        try:
            fp32 = _run(trainer, ids, mask, C, comp_mask, share=False)
        finally:
            trainer.accelerator.native_amp = amp
        assert float((fp32[0] - plain[0]).abs().max()) > 1e-4


def test_hint_drafts_are_the_hints_greedy_decoding_writes_on_the_gpu(tiny_model_dir):
    """Generation runs in float32 on the GPU (TRL autocasts only the loss): a draft checked in one forward by CUDA's
    kernels is the hint that generate's token-by-token decoding writes."""
    from test_hint_drafts import _greedy

    from sage_core.data import build_dataset
    from sage_core.hint_drafts import HintDrafts
    from sage_core.hints import HintRequest, request_prompt
    from sage_core.models import load_policy
    from sage_core.presets import preset

    model, tok = load_policy(str(tiny_model_dir))
    model = model.to("cuda").eval()
    rows = list(build_dataset(preset("tiny-cpu", num_prompts=16)))
    prompts = [tok.apply_chat_template(request_prompt(HintRequest(r["prompt_id"], r["problem"], r["solution"],
                                                                  r["answer"], 1 + i % 3)),
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for i, r in enumerate(rows)]
    max_new = 48
    hints = _greedy(model, tok, prompts, max_new)  # generate's token-by-token greedy decoding, on the GPU
    drafts = HintDrafts([tok.eos_token_id], tok.pad_token_id)
    for p, h in zip(prompts, hints, strict=True):
        drafts.remember(p, h)
    checked = drafts.check(model, prompts, max_new)
    assert [t for t, _ in checked] == hints
    assert all(done for _, done in checked)  # each ended at its EOS or at the limit: no decode loop left


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_generation_cache_gives_generates_own_rollouts_on_the_gpu(tiny_model_dir, sample):
    """HF generate handed the groups' cache (sage_core.generation_cache: each prompt prefilled once, keys appended
    in place) writes, with CUDA's kernels and the same seed, the tokens of its own prefill, with every step's scores
    within float rounding; a prompt's rows lie apart in the batch here."""
    from test_generation_cache import _generate, _groups
    from transformers import AutoModelForCausalLM, GenerationConfig

    from sage_core.generation_cache import generation_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to("cuda").eval()
    ids, mask = (t.to("cuda") for t in _groups(shuffle=True))
    conf = GenerationConfig(max_new_tokens=24, do_sample=sample, temperature=1.0, pad_token_id=0, eos_token_id=1)
    plain = _generate(model, ids, mask, conf)
    cache = generation_cache(model, ids, mask, conf.max_new_tokens)
    assert cache is not None and cache.layers[0].keys.device.type == "cuda"
    shared = _generate(model, ids, mask, conf, cache)
    assert torch.equal(plain.sequences, shared.sequences)
    for a, b in zip(plain.scores, shared.scores, strict=True):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        torch.testing.assert_close(a[finite], b[finite], atol=1e-4, rtol=1e-4)
