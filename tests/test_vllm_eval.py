"""No-hint evaluation through vLLM (sage_core.evaluate, use_vllm=True), on vLLM's CPU build; skipped where vLLM is not
installed (`make test-vllm`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these tests in .venv-vllm)")

from sage_core.presets import preset


def test_eval_on_vllm_reads_prompts_with_the_models_own_tokenizer(tiny_model_dir, monkeypatch):
    """No-hint eval through vLLM agrees with the HF path, greedy: vLLM gets token ids from the tokenizer the trainer
    uses (its own AutoTokenizer load reads the tiny word-level tokenizer as a Qwen2Tokenizer with other ids). Greedy
    with k=2: vLLM refuses n > 1 when greedy, so one completion is copied k times, as on the HF path."""
    from transformers import AutoTokenizer

    from sage_core.data import build_dataset
    from sage_core.evaluate import _generate_vllm, generate_hf, render_prompt, summarise
    from sage_core.models import load_policy

    # the engine in this process: it starts faster. On vLLM's CPU build its KV cache then gets
    # gpu_memory_utilization x the NUMA node's memory minus this process's RSS, which the earlier vLLM tests in
    # the same pytest process have grown: 0.1 of a 10 GiB node left nothing (seen in CI), 0.3 leaves about 2 GiB
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    msgs = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]
    model, tok = load_policy("tiny")
    auto = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert auto.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"] != tok.apply_chat_template(
        msgs, add_generation_prompt=True)["input_ids"]  # why vLLM must not tokenize the text itself
    rows = list(build_dataset(preset("tiny-cpu", num_prompts=16, difficulty="easy")))
    hf = generate_hf(model, tok, [render_prompt(tok, r) for r in rows], k=2, temperature=0.0, max_new_tokens=40)
    import vllm

    engines, real_llm = [], vllm.LLM

    def llm(*a, **kw):  # the engine as _generate_vllm builds it
        engines.append(real_llm(*a, **kw))
        return engines[-1]

    monkeypatch.setattr(vllm, "LLM", llm)
    vl = _generate_vllm("tiny", {"easy": rows}, k=2, temperature=0.0, top_p=0.95, max_new_tokens=40, seed=0,
                        gguf_file=None, gpu_memory_utilization=0.3)["easy"]
    # the engine's context is the longest prompt plus the new tokens, not the model's 256
    longest = max(len(tok(render_prompt(tok, r), add_special_tokens=False)["input_ids"]) for r in rows)
    assert engines[0].model_config.max_model_len == longest + 40 < 256
    same = sum(a == b for a, b in zip(hf, vl, strict=True))
    assert same >= 14, list(zip(hf, vl))  # float32 on both sides; a near-tie may tip a greedy token
    assert any("\\boxed" in c[0] for c in vl)
    assert all(len(c) == 2 and c[0] == c[1] for c in vl)  # the greedy completion, twice
    greedy = summarise(rows, [c[:1] for c in vl], k=1)["avg_at_k"]
    res = summarise(rows, vl, k=2)
    assert res["avg_at_k"] == res["pass_at_k"] == greedy > 0


@pytest.mark.slow  # an engine of its own (about 30 s): make test-all runs it
def test_eval_on_vllm_of_a_lora_checkpoint_runs_the_merged_model(tiny_model_dir, tmp_path, monkeypatch):
    """A LoRA run's checkpoint holds adapters only: vLLM is handed the base with them merged, and its greedy
    completions are the HF path's on the same merged model."""
    import torch
    from helpers import lora_checkpoint

    from sage_core.data import build_dataset
    from sage_core.evaluate import _generate_vllm, generate_hf, render_prompt
    from sage_core.models import load_policy

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    lora_checkpoint(load_policy("tiny")[0], preset("tiny-cpu", lora_r=4), tmp_path / "ckpt", std=0.05)
    model, tok = load_policy(str(tmp_path / "ckpt"))
    assert not torch.equal(model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           load_policy("tiny")[0].state_dict()["model.layers.0.self_attn.q_proj.weight"])
    rows = list(build_dataset(preset("tiny-cpu", num_prompts=16, difficulty="easy")))
    hf = generate_hf(model, tok, [render_prompt(tok, r) for r in rows], k=1, temperature=0.0, max_new_tokens=40)
    import vllm

    served, real_llm = [], vllm.LLM

    def llm(*a, **kw):
        served.append(kw["model"])
        return real_llm(*a, **kw)

    monkeypatch.setattr(vllm, "LLM", llm)
    vl = _generate_vllm(str(tmp_path / "ckpt"), {"easy": rows}, k=1, temperature=0.0, top_p=1.0, max_new_tokens=40,
                        seed=0, gguf_file=None, gpu_memory_utilization=0.3)["easy"]
    assert sum(a == b for a, b in zip(hf, vl, strict=True)) >= 14, list(zip(hf, vl))
    import os

    assert served[0] != str(tmp_path / "ckpt") and not os.path.exists(served[0])  # a merged copy, removed after
