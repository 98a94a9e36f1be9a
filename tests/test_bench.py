"""benchmarks/overhead.py and learning.py, run for real on a small setting: their numbers are the ones the tables
claim."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_overhead_bench_ratios_work_and_signal(tiny_model_dir):
    ob = _bench("overhead")
    rows = ob.run("tiny-cpu", 2, ["grpo", ob.TRL_GRPO, "sage", "sage:lookahead=false"],
                  dict(num_prompts=8, prompts_per_step=4, measure_activations=True), repeats=1)
    by = {r["method"]: r for r in rows}
    # the tiny-cpu preset rolls SAGE's later levels ahead; the variant searches one level per pass
    grpo, trl, sage, seq = by["grpo"], by[ob.TRL_GRPO], by["sage"], by["sage:lookahead=false"]
    assert grpo["ratio"] == grpo["gen_x"] == grpo["train_x"] == trl["vs_trl"] == 1.0
    # stock TRL GRPO rolls out and trains the same rows as method=grpo (counted from TRL's own metrics)
    assert trl["rollouts"] == grpo["rollouts"] and trl["gen_x"] == pytest.approx(1.0)
    assert trl["train_x"] == 1.0 and trl["open_groups"] == pytest.approx(grpo["open_groups"])
    assert sage["vs_trl"] == pytest.approx(sage["seconds"] / trl["seconds"])
    # activation memory: TRL keeps every row's activations for the backward; method=grpo only the rows with a
    # non-zero advantage, and SAGE (more open groups, longer hinted prompts) more than that GRPO
    assert 0 < grpo["activation_mb"] < trl["activation_mb"] and grpo["activation_mb"] < sage["activation_mb"]
    assert sage["ratio"] == pytest.approx(sage["seconds"] / grpo["seconds"])
    # SAGE re-rolls collapsed groups: more rollouts and more tokens generated than GRPO, on the same prompts
    assert sage["rollouts"] > grpo["rollouts"] == 2 * 4 * 8
    assert sage["gen_x"] > 1.0 and sage["gen_x"] == pytest.approx(sage["gen_tokens"] / grpo["gen_tokens"])
    # learning signal: open groups (mixed rewards) as a ratio to GRPO, and the time per open group
    assert 0 <= grpo["open_groups"] <= 8 and sage["open_groups"] >= grpo["open_groups"]
    if grpo["open_groups"]:
        assert grpo["open_x"] == 1.0 and sage["open_x"] == sage["open_groups"] / grpo["open_groups"]
        assert sage["per_open_x"] == pytest.approx(sage["ratio"] / sage["open_x"])
    # sequential generate calls per step: GRPO (both) one rollout pass; SAGE one per level round, plus hint passes
    assert grpo["passes"] == trl["passes"] == (1.0, 0.0)
    assert sage["passes"][0] > 1 and sage["passes"][1] >= 1
    # the time split covers rolling out and writing hints (GRPO writes none)
    assert grpo["hint_share"] == 0 and 0 < grpo["gen_share"] < 1
    assert 0 < sage["hint_share"] and sage["gen_share"] + sage["hint_share"] < 1
    table = ob.report(rows)
    lines = table.splitlines()
    assert "s/open x" in lines[0] and "x TRL" in lines[0] and len(lines) == 6
    target = ob.TARGETS["sage"]  # the verdicts against this trainer's GRPO, then TRL's
    for line, r in ((lines[4], sage), (lines[5], seq)):  # a variant is judged by its method's target
        verdicts = "/".join("MISS" if x > target else "ok" for x in (r["ratio"], r["vs_trl"]))
        assert line.startswith(r["method"] + " ") and f" <={target} {verdicts} " in line
    assert not math.isnan(sage["gen_share"])
    # the variant ran with its own setting: the same search, one level per pass (the same seed and first rollout;
    # with lookahead the later levels roll in fewer passes, and the ones it rolled ahead and did not need count as
    # spent)
    assert sage["passes"][0] < seq["passes"][0] and sage["rollouts"] >= seq["rollouts"]


def test_overhead_bench_method_variants():
    ob = _bench("overhead")
    assert ob.split_variant("sage") == ("sage", {})
    assert ob.split_variant("sage:lookahead=true:hint-retries=0") == ("sage", {"lookahead": "true",
                                                                             "hint_retries": "0"})
    with pytest.raises(SystemExit):  # an unknown field is refused before anything trains
        ob.main(["--methods", "grpo,sage:lookahed=true"])
    with pytest.raises(SystemExit):
        ob.main(["--methods", "grpo", "--warmup-steps", "0"])


def test_overhead_bench_warms_up_every_step_on_cuda_and_one_on_cpu(monkeypatch):
    import torch

    ob = _bench("overhead")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ob.warmup_steps(8) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ob.warmup_steps(8) == 8


def test_learning_bench_compares_paired_no_hint_scores(tiny_model_dir, capsys):
    """benchmarks/learning.py: each method's no-hint scores after training, paired with the starting model's and
    GRPO's on the same prompts and sampling seed (the evaluation is deterministic, so a change is the training's)."""
    from sage_core.data import build_dataset, eval_rows
    from sage_core.evaluate import evaluate_rows
    from sage_core.models import load_policy
    from sage_core.presets import preset

    lb = _bench("learning")
    over = {"max_steps": 2, "num_prompts": 8, "prompts_per_step": 4, "eval_num_prompts": 8, "eval_k": 2}
    recs = lb.run("tiny-cpu", ["grpo", "sage"], [0], over)
    by = {r["method"]: r for r in recs}
    assert list(by) == [lb.BASE, "grpo", "sage"]
    spec = preset("tiny-cpu", **over)
    held, train = [dict(r) for r in eval_rows(spec)], [dict(r) for r in build_dataset(spec)]
    assert by["sage"]["n_held"] == len(held) == 8
    assert by["sage"]["n_hard"] == sum(r["difficulty"] >= lb.HARD for r in held)
    again = lb._scores(*load_policy("tiny"), (held, train), spec)  # the start, scored again: the same numbers
    assert again == pytest.approx({k: by[lb.BASE][k] for k in again}, abs=0, nan_ok=True)
    # the hard subset's avg@k comes from the held-out samples of its prompts
    res = evaluate_rows(*load_policy("tiny"), held, k=2, temperature=spec.eval_temperature, top_p=spec.eval_top_p,
                        max_new_tokens=spec.max_completion_length, seed=spec.seed)
    assert res["avg_at_k"] == by[lb.BASE]["held_avg"]
    hard = [res["per_prompt"][r["prompt_id"]] for r in held if r["difficulty"] >= lb.HARD]
    assert by[lb.BASE]["hard_avg"] == pytest.approx(sum(hard) / len(hard) if hard else math.nan, nan_ok=True)
    # never solved during training counts hinted successes too: no higher than without hints
    assert by["sage"]["never_solved"] <= by["sage"]["never_solved_no_hint"]
    rows = {r["method"]: r for r in lb.summarize(recs)}
    sage, grpo = rows["sage"], rows["grpo"]
    d = by["sage"]["held_avg"] - by["grpo"]["held_avg"]
    assert sage["held_avg_vs_grpo"] == (d, d, d) and grpo["held_avg_vs_grpo"] is None
    d = by["sage"]["train_avg"] - by[lb.BASE]["train_avg"]
    assert sage["train_avg_vs_start"] == (d, d, d) and rows[lb.BASE]["held_avg_vs_start"] is None
    assert sage["time_x_grpo"] == by["sage"]["train_seconds"] / by["grpo"]["train_seconds"]
    lines = lb.report(list(rows.values()), 2).splitlines()
    assert "held avg@2" in lines[0] and "vs GRPO" in lines[0] and len(lines) == 5
    assert lines[4].startswith("sage") and f"{100 * by['sage']['held_avg']:.1f}" in lines[4]
    with pytest.raises(SystemExit) as e:  # a seed or method given through --set would be silently overridden
        lb.main(["--set", "seed=3"])
    assert e.value.code == 2 and "--seeds" in capsys.readouterr().err


def test_benches_refuse_set_of_fields_their_flags_own(monkeypatch, capsys, tmp_path):
    """A field a flag sets (the method, the step count, ...) is refused in --set, as learning.py refuses seed and
    method: overhead.py passed it to preset() beside the flag's (a TypeError after the imports), and gpu_smoke.py let
    it override every row's (`--set method=sage` trained SAGE in the rows named grpo and trl-grpo's spec)."""
    import subprocess

    ob = _bench("overhead")
    for argv, field in ((["--set", "max_steps=3"], "max_steps"), (["--set", "method=sage"], "method"),
                        (["--methods", "grpo,sage:method=grpo"], "method")):
        with pytest.raises(SystemExit) as e:
            ob.main(argv)
        assert e.value.code == 2 and field in capsys.readouterr().err
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    ran = []  # no child trains: each "fails" at once
    monkeypatch.setattr(subprocess, "run", lambda cmd, check=False: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 1))
    for field in ("method=sage", "max_steps=9", "seed=5", "model=tiny"):
        with pytest.raises(SystemExit) as e:
            gs.main(["--hf-generate", "--methods", "grpo", "--out", str(tmp_path), "--set", field])
        assert e.value.code == 2 and field.split("=")[0] in capsys.readouterr().err
    assert ran == []


def test_gpu_smoke_activation_memory_is_the_largest_step_first_included():
    """gpu_smoke's act_MB is the largest step's, as its table says and overhead.py's `act MB` is: leaving step 1 out
    (as the time means do, for its warm-up) reported less where step 1 held the most (SAGE's did on tiny-cpu)."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    history = [{"step_time": 9.0, "sage/activation_mb": 60.0}, {"step_time": 1.0, "sage/activation_mb": 40.0},
               {"step_time": 3.0, "sage/activation_mb": 30.0}, {"train_runtime": 13.0}]
    m = gs.step_metrics(history)
    assert m["steps"] == 2 and m["step_s"] == 2.0  # the time means still leave step 1 out
    assert m["act_mb"] == 60.0


def test_learning_bench_scores_every_model_in_float32(tiny_model_dir, monkeypatch, tmp_path):
    """The start and the trained models are scored in one precision, float32 (what training starts from and a full
    fine-tune saves): loaded as their checkpoints say, a bfloat16 base (most instruct models) scored the start in
    bfloat16 and the trained models in float32, so `vs start` mixed a change of precision into the training's."""
    import json
    import shutil
    from types import SimpleNamespace

    import torch

    from sage_core import models

    lb = _bench("learning")
    bf16 = tmp_path / "tiny-bf16"  # the tiny model, its config asking for bfloat16
    shutil.copytree(tiny_model_dir, bf16)
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(models, "tiny_model_path", lambda *a, **k: bf16)
    # no training: a run whose final/ is in the base's dtype (a LoRA run's merged model)
    monkeypatch.setattr("sage_core.train.train", lambda spec, out, resume: SimpleNamespace(
        checkpoint_dir=bf16, summary={"train_seconds": 1.0, "never_solved": 0.5, "never_solved_no_hint": 0.5}))
    dtypes = []

    def scores(model, tokenizer, rows, spec):
        dtypes.append(next(model.parameters()).dtype)
        return {"held_avg": 0.0, "held_pass": 0.0, "hard_avg": 0.0, "train_avg": 0.0, "n_held": 4, "n_hard": 0}

    monkeypatch.setattr(lb, "_scores", scores)
    recs = lb.run_seed("tiny-cpu", ["grpo"], 0, {"num_prompts": 8, "eval_num_prompts": 4})
    assert [r["method"] for r in recs] == [lb.BASE, "grpo"]
    assert dtypes == [torch.float32, torch.float32]
