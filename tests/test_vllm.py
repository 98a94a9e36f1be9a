"""SAGE on vLLM: TRL's colocate path, the one the GPU presets use, run for real on vLLM's CPU build.

Skipped where vLLM is not installed (`make test` runs it in its own venv: `make test-vllm`, see the Makefile).
No-hint evaluation through vLLM: tests/test_vllm_eval.py.
One module fixture trains online-hint SAGE for two steps with use_vllm=True; the tests check what only the vLLM path
can get wrong: the engine generates from the policy's current weights, the hinted re-rolls are scored in the
context vLLM sampled them from, and hint writing switches vLLM's sampling settings and restores them.
"""

from __future__ import annotations

import pytest
import torch
from helpers import global_metrics, metric, run_two_ranks
from transformers import TrainerCallback

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these tests in .venv-vllm)")

from sage_core.presets import preset
from sage_core.prompts import HINT_HEADER
from sage_core.tracker import read_tracker
from sage_core.train import build_trainer, release_vllm

# vLLM's names for the tiny Qwen2's unfused weights (q, k, v and gate, up are fused in the engine)
SYNCED = ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight",
          "model.layers.1.input_layernorm.weight")


class _Snapshot(TrainerCallback):
    """The policy's weights at the end of each optimizer step."""

    def __init__(self, model):
        self.model, self.after = model, {}

    def on_step_end(self, args, state, control, **kw):
        params = dict(self.model.named_parameters())
        self.after[state.global_step] = {k: params[k].detach().clone() for k in SYNCED}


@pytest.fixture(scope="module")
def sage_vllm(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sage_vllm")
    spec = preset("tiny-cpu", method="sage", num_prompts=16, max_steps=2, use_vllm=True,
                  vllm_gpu_memory_utilization=0.1, save_steps=100, eval_every=2, eval_k=2, eval_num_prompts=4,
                  eval_temperature=0.5, eval_top_p=0.9)
    trainer = build_trainer(spec, out)
    initial = {k: p.detach().clone() for k, p in trainer.model.named_parameters() if k in SYNCED}
    snap = _Snapshot(trainer.model)
    trainer.add_callback(snap)
    calls, seen = [], []
    roll, loss = trainer._roll, trainer._compute_loss

    def spy_roll(prompts, kind="reroll"):  # vLLM's sampling settings at each generate call, and what came back
        gen = trainer.vllm_generation
        ids, comp_ids, comps, lps = roll(prompts, kind)
        engine = gen.llm.llm_engine.model_executor.driver_worker.model_runner.model
        calls.append(dict(kind=kind, rows=len(prompts), temperature=gen.temperature, top_p=gen.top_p,
                          max_tokens=gen.max_completion_length, lengths=[len(c) for c in comp_ids],
                          logprobs=lps is not None, step=trainer.state.global_step, prompts=prompts,
                          engine={k: p.detach().clone() for k, p in engine.named_parameters() if k == SYNCED[0]}))
        return ids, comp_ids, comps, lps

    def spy_loss(model, inputs):
        seen.append(trainer.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True))
        return loss(model, inputs)

    trainer._roll, trainer._compute_loss = spy_roll, spy_loss
    trainer.train()
    engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    in_engine = {k: p.detach().clone() for k, p in engine.named_parameters() if k in SYNCED}
    ctx = trainer._context_limit()  # what every generate call is checked against (tests/test_context.py)
    eager = trainer.vllm_generation.llm.llm_engine.vllm_config.model_config.enforce_eager
    # the engine goes now, not at module teardown: the tests below start engines of their own, and beside
    # this one on 2 cores the gpu_smoke test failed (each passes alone)
    release_vllm(trainer)
    return dict(trainer=trainer, out=out, spec=spec, initial=initial, after=snap.after, engine=in_engine,
                calls=calls, seen=seen, ctx=ctx, eager=eager)


def test_prompts_are_checked_against_the_engines_context(sage_vllm):
    """With no max_prompt_length, vLLM sizes its context from the model config; the trainer reads it back."""
    assert sage_vllm["ctx"] == sage_vllm["trainer"].model.config.max_position_embeddings == 256


def test_engines_start_eager_without_cuda(sage_vllm, monkeypatch):
    """TRL builds its engine without enforce_eager; without CUDA it starts eager (no torch.compile at start, which
    bought nothing on the CPU build). SAGE_VLLM_EAGER decides either way; a value other than 0/1 is named."""
    from sage_core.vllm_cpu import eager_engines

    assert sage_vllm["eager"] is True
    monkeypatch.setenv("SAGE_VLLM_EAGER", "0")
    assert not eager_engines()
    monkeypatch.setenv("SAGE_VLLM_EAGER", "yes")
    with pytest.raises(ValueError, match="SAGE_VLLM_EAGER='yes': set 1"):
        eager_engines()


def test_engine_generates_from_the_policy_weights_of_the_step(sage_vllm):
    """TRL syncs the policy into vLLM before each step's first generation: the second step's hint and re-roll
    calls generate from the weights the first update produced, and the eval after the second update (eval_every)
    from the weights that update produced, which the engine still holds at the end (vLLM's CPU build would have
    dropped them without sage_core.vllm_cpu)."""
    initial, after, engine = sage_vllm["initial"], sage_vllm["after"], sage_vllm["engine"]
    assert set(engine) == set(SYNCED) and sorted(after) == [1, 2]
    moved = [k for k in SYNCED if not torch.equal(after[1][k], initial[k])]
    assert moved, "the first update should change the policy"
    k0, n = SYNCED[0], after[1][SYNCED[0]].shape[0]
    second = [c for c in sage_vllm["calls"] if c["step"] == 1 and c["kind"] != "eval" and c["rows"]]
    evals = [c for c in sage_vllm["calls"] if c["kind"] == "eval"]
    assert second and [c["step"] for c in evals] == [2]

    def held(call, step):  # the engine's copy of the weight at a call is the policy's after `step`'s update
        got = call["engine"][k0][:n]
        return torch.equal(got, after[step][k0].to(got.dtype))

    assert all(held(c, 1) and not held(c, 2) for c in second)
    assert held(evals[0], 2) and not held(evals[0], 1)
    for k in SYNCED:
        want = after[2][k]
        got = engine[k][tuple(slice(0, n) for n in want.shape)]  # vLLM pads the vocabulary to a multiple of 64
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)
        assert not torch.equal(got, initial[k]) or k not in moved


def test_hinted_rerolls_are_trained_in_the_context_vllm_sampled_them_from(sage_vllm):
    trainer, out, seen = sage_vllm["trainer"], sage_vllm["out"], sage_vllm["seen"]
    df = read_tracker(out / "tracker")
    assert (df.base_state == "all0").any(), "the tiny task should collapse some groups"
    assert (df[df.base_state == "all0"].max_level_tried >= 1).all()
    G = sage_vllm["spec"].num_generations
    # the loss sees the hint exactly on the rows of the groups trained at a level
    assert [sum(HINT_HEADER in p for p in batch) for batch in seen] == [
        G * int((df[df.step == s].level > 0).sum()) for s in (1, 2)]
    # vLLM's sampling log-probs against the trainer's on the same rows: the hinted rows were recomputed on the
    # prompt vLLM saw (a hint missing on either side moves these by far more), so the importance ratio stays near 1
    diffs = metric(trainer, "sampling/sampling_logp_difference/mean")
    ratios = metric(trainer, "sampling/importance_sampling_ratio/mean")
    assert len(diffs) == len(ratios) == 2
    assert max(diffs) < 0.02 and all(abs(r - 1) < 0.05 for r in ratios)


def test_the_eval_samples_with_its_own_settings_on_the_engine_without_hints(sage_vllm):
    """eval_every: the held-out prompts, k of each, no hint, at the eval's temperature and top-p and the rollout
    length; the rollouts' settings are back afterwards, and the scores are in the step's log."""
    trainer, spec = sage_vllm["trainer"], sage_vllm["spec"]
    (ev,) = [c for c in sage_vllm["calls"] if c["kind"] == "eval"]
    assert ev["rows"] == spec.eval_num_prompts * spec.eval_k and not any(HINT_HEADER in str(p) for p in ev["prompts"])
    assert (ev["temperature"], ev["top_p"], ev["max_tokens"]) == (spec.eval_temperature, spec.eval_top_p,
                                                                  spec.max_completion_length)
    gen = trainer.vllm_generation
    assert (gen.temperature, gen.top_p, gen.max_completion_length) == (spec.temperature, trainer.args.top_p,
                                                                       spec.max_completion_length)
    avg = metric(trainer, "eval/during/synthetic-heldout/avg_at_2")
    passed = metric(trainer, "eval/during/synthetic-heldout/pass_at_2")
    assert len(avg) == len(passed) == 1 and 0 <= avg[0] <= passed[0] <= 1


def test_hint_writing_switches_vllm_sampling_and_restores_it(sage_vllm):
    trainer, calls, spec = sage_vllm["trainer"], sage_vllm["calls"], sage_vllm["spec"]
    hints = [c for c in calls if c["kind"] == "hint" and c["rows"]]
    rerolls = [c for c in calls if c["kind"] == "reroll" and c["rows"]]
    assert hints and rerolls
    assert all(c["temperature"] == spec.hint_temperature and c["max_tokens"] == spec.hint_max_tokens for c in hints)
    assert all(max(c["lengths"]) <= spec.hint_max_tokens for c in hints)
    # re-rolls sample like the first rollout, with vLLM's log-probs, whatever hint call came before them
    assert all(c["temperature"] == spec.temperature and c["max_tokens"] == spec.max_completion_length
               and c["logprobs"] for c in rerolls)
    assert max(n for c in rerolls for n in c["lengths"]) <= spec.max_completion_length
    assert trainer.vllm_generation.temperature == spec.temperature
    assert trainer.vllm_generation.max_completion_length == spec.max_completion_length
    # the pass counts the trainer logs are the generate calls that ran
    assert sum(metric(trainer, "sage/hint_passes")) == len(hints)
    assert sum(metric(trainer, "sage/rollout_passes")) == 2 + len(rerolls)


@pytest.mark.slow  # about 35 s (an engine of its own starts): make test-all runs it; make test stays under 15 min
def test_lora_adapters_reach_the_engine_merged(tiny_model_dir, tmp_path):
    """With lora_r, TRL merges the adapters into the weights it syncs: after one update the engine generates from
    base + B @ A x alpha / r, and the trained base weights stay where they were (up to the merge's rounding)."""
    spec = preset("tiny-cpu", method="sage", num_prompts=16, max_steps=2, use_vllm=True, save_steps=100,
                  vllm_gpu_memory_utilization=0.1, lora_r=4, learning_rate=1e-2)
    trainer = build_trainer(spec, tmp_path)
    name = "model.layers.0.self_attn.o_proj"
    layer = dict(trainer.model.named_modules())["base_model.model." + name]
    base0 = layer.base_layer.weight.detach().clone()
    merged = {}

    class Merged(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            merged[state.global_step] = (layer.base_layer.weight + layer.get_delta_weight("default")).detach().clone()

    trainer.add_callback(Merged())
    try:
        trainer.train()
        engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
        got = dict(engine.named_parameters())[name + ".weight"].detach().clone()
    finally:
        release_vllm(trainer)
    assert not torch.equal(merged[1], base0)  # the adapters learned something in step 1
    torch.testing.assert_close(got, merged[1].to(got.dtype), rtol=0, atol=0)  # synced before step 2's rollout
    torch.testing.assert_close(layer.base_layer.weight.detach(), base0, rtol=0, atol=1e-6)


@pytest.mark.slow  # about 75 s (two engines start): make test-all runs it
def test_gpu_smoke_runs_on_the_vllm_cpu_build(tiny_model_dir, tmp_path):
    """benchmarks/gpu_smoke.py end to end, each method in its own process with its own engine, as on a GPU."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out, js = tmp_path / "smoke", tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_smoke.py"), "--methods", "grpo,sage",
                        "--steps", "2", "--gpu-mem", "0.2", "--out", str(out), "--json", str(js)],
                       capture_output=True, text=True, cwd=root, env={**os.environ}, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = json.loads(js.read_text())
    assert table["failed"] == [] and "vLLM CPU build" in table["header"] and set(table["rows"]) == {"grpo", "sage"}
    grpo, sage = table["rows"]["grpo"], table["rows"]["sage"]
    spec = json.loads((out / "sage" / "smoke_metrics.json").read_text())["spec"]
    G, P = spec["num_generations"], spec["prompts_per_step"]
    assert spec["use_vllm"] and spec["method"] == "sage" and not spec["bf16"]
    assert grpo["steps"] == sage["steps"] == 1  # step 1 (engine warm-up) is left out of the means
    assert grpo["rollouts"] == G * P <= sage["rollouts"] <= G * P * 4  # SAGE re-rolls at most 3 levels per group
    assert grpo["gen_s"] > 0 and sage["gen_s"] > 0 and grpo["step_s"] > grpo["gen_s"]
    assert 0 <= grpo["reward"] <= 1 and grpo["peak_gib"] > 0 and grpo["act_mb"] > 0
    assert "step_s/GRPO" in r.stdout and "1.00x" in r.stdout


def test_two_ranks_with_an_engine_each_agree_and_exit_cleanly(tiny_model_dir, tmp_path):
    """The GPU presets' layout, colocate on every rank, on 2 CPU processes: the ranks replay the same groups (equal
    work, one scheduler state) and the run ends without vLLM's teardown tripping over a destroyed process group."""
    proc, r0, r1 = run_two_ranks(tmp_path, "sage", {"use_vllm": True, "vllm_gpu_memory_utilization": 0.15})
    assert "Traceback" not in proc.stderr and "Invalid process group" not in proc.stderr, proc.stderr[-4000:]
    assert r0["scheduler"] == r1["scheduler"] and r0["seen"] == r1["seen"] and len(r0["seen"]) >= 4
    assert global_metrics(r0["history"]) == global_metrics(r1["history"])
    steps = [h for h in r0["history"] if "sage/frac_collapsed" in h]
    assert len(steps) == 2 and all(h["sage/rollout_passes"] >= 1 for h in steps)
    assert len(sorted((tmp_path / "tracker").glob("step_*.parquet"))) == 2  # written once, by rank 0

