"""Two processes (torchrun, gloo on CPU): collapse decided per prompt group, equal work on every rank, and
scheduler state identical on both ranks afterwards. The module's runs share one launch (`runs`)."""

import pandas as pd
import pytest
from helpers import global_metrics, run_jobs_on_two_ranks, two_rank_job

AGREE = ["sage-light+ada-seq", "sage", "ada-est", "dapo-filter"]
EVAL = {"eval_every": 1, "eval_num_prompts": 5, "eval_k": 2, "eval_temperature": 0.0}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """name -> (output folder, rank 0's state, rank 1's state), from one torchrun launch running the jobs in turn."""
    root = tmp_path_factory.mktemp("two-ranks")
    jobs = {m: two_rank_job(root / m, m, {"save_steps": 1}) for m in AGREE}  # checkpoints: a collective on every rank
    # one rank splits every length into a bucket, the other never does (see the test); a hang fails the launch
    jobs["buckets"] = two_rank_job(root / "buckets", "sage", bucket_overhead=(0, 10**9))
    # 5 held-out prompts: one rank evaluates 3, the other 2 (and a padding row)
    jobs["eval"] = two_rank_job(root / "eval", "sage-light", {"save_steps": 1, **EVAL})
    # each rank reads its own next batch ahead and writes its own next step's hint drafts in its rollout pass
    jobs["prefetch"] = two_rank_job(root / "prefetch", "sage-light", {"hint_prefetch": True, "max_steps": 4})
    _, states = run_jobs_on_two_ranks(list(jobs.values()), timeout=420)
    return {name: (root / name, *st) for name, st in zip(jobs, states, strict=True)}


@pytest.mark.parametrize("method", AGREE)
def test_two_processes_agree(runs, method):
    out, r0, r1 = runs[method]
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert r0["scheduler"] == r1["scheduler"]  # SAGE-LIGHT levels replayed from every rank's groups
    assert r0["seen"] == r1["seen"] and len(r0["seen"]) >= 4
    assert global_metrics(r0["history"]) == global_metrics(r1["history"])
    assert sum("sage/frac_collapsed" in h for h in r0["history"]) == 2
    files = sorted((out / "tracker").glob("step_*.parquet"))
    assert len(files) == 2  # written once, by rank 0
    for f in files:
        df = pd.read_parquet(f)
        assert df.trained.sum() == 4 and df.prompt_id.is_unique  # all 4 groups of both ranks, each once
        if method != "dapo-filter":
            assert len(df) == 4
        else:  # prompts swapped in on either rank: none twice, none another rank's own (checked: unique ids)
            assert (df.origin_id[df.trained].nunique() == 4) and set(df.origin_id) <= set(df.prompt_id)
    if method == "dapo-filter":
        assert sum(h.get("sage/new_prompts", 0) for h in r0["history"]) > 0, "no prompt was swapped: nothing tested"
    if method == "ada-est":  # c fitted on the pilots of both ranks' groups, the same on both
        assert len(r0["scheduler"]["history"]) == 8
    if method.startswith("sage-light"):
        second = pd.read_parquet(files[1]).set_index("prompt_id")
        levels = r0["scheduler"]["levels"]
        assert all(0 <= levels[p] <= 3 for p in second.index)


def test_two_processes_prefetching_hints_agree(runs):
    """Hint prefetch on two ranks: each rank's rollout pass carries its own next step's requests (different counts
    on the ranks: no collective counts them), and the ranks still train and track as one."""
    out, r0, r1 = runs["prefetch"]
    assert r0["scheduler"] == r1["scheduler"]
    assert global_metrics(r0["history"]) == global_metrics(r1["history"])
    assert sum(h.get("sage/hint_prefetch_rows", 0) for h in r0["history"]) > 0
    assert len(sorted((out / "tracker").glob("step_*.parquet"))) == 4


def test_ranks_whose_loss_forwards_differ_in_count_do_not_wait_on_each_other(runs):
    """The loss's forward runs once per length bucket, and each rank buckets its own rows, so ranks make different
    numbers of forwards. DDP's default broadcast of module buffers makes every forward a collective: the rank with
    fewer forwards went on to the loss's all-reduce while the other waited in its next forward's broadcast, forever
    (seen on two CPU ranks). Here one rank splits every length into a bucket and the other never splits."""
    _, r0, r1 = runs["buckets"]
    assert r0["forwards"] > r1["forwards"] > 0
    assert global_metrics(r0["history"]) == global_metrics(r1["history"])
    assert r0["scheduler"] == r1["scheduler"]


def test_two_processes_evaluate_their_shares_of_the_held_out_set_as_one_process_would(runs):
    """eval_every on 2 ranks: each rolls out its share of the held-out prompts (3 and 2, with a padding row), both
    log the scores of the whole set, and they are those of one process evaluating the step's checkpoint."""
    from sage_core.data import eval_rows
    from sage_core.evaluate import evaluate
    from sage_core.spec import recorded_spec

    out, r0, r1 = runs["eval"]
    key = "eval/during/synthetic-heldout/avg_at_2"
    logged = [[(h["step"], h[key], h[key.replace("avg", "pass")]) for h in r["history"] if key in h] for r in (r0, r1)]
    assert logged[0] == logged[1] and [s for s, _, _ in logged[0]] == [1, 2]
    spec = recorded_spec(out)
    rows = eval_rows(spec).to_list()
    assert len(rows) == 5
    for step, avg, passed in logged[0]:
        offline = evaluate(str(out / f"checkpoint-{step}"), {"synthetic-heldout": rows}, k=2, temperature=0.0,
                           max_new_tokens=spec.max_completion_length).iloc[0]
        assert (avg, passed) == pytest.approx((offline.avg_at_k, offline.pass_at_k))


def test_ddp_broadcasts_buffers_only_when_every_process_runs_the_same_forwards(tmp_path):
    from sage_core.trainer import SageConfig

    kw = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "per_device_train_batch_size": 8,
          "num_generations": 8, "report_to": "none"}
    assert SageConfig(**kw).ddp_broadcast_buffers is False  # length buckets (the default): per-process forwards
    assert SageConfig(**kw, sage_length_buckets=False).ddp_broadcast_buffers is None  # TRL's loop: DDP's default
    with pytest.raises(ValueError, match="sage_length_buckets=False"):
        SageConfig(**kw, ddp_broadcast_buffers=True)


def test_two_processes_resumed_mid_epoch_follow_the_straight_run(tiny_model_dir, tmp_path):
    """8 prompts, 4 a step: an epoch is 2 steps. Stopped at step 3 (the middle of the second epoch) and resumed to 4
    on 2 processes, the run rolls out the prompts of the straight run's step 4. HF skips the batches trained on a
    resume through accelerate's SkipBatchSampler, and its set_epoch did not reach the sampler under the processes'
    BatchSamplerShard: the resumed step 4 rolled out epoch 0's second batch (one process gets it right)."""
    from sage_core.tracker import read_tracker

    over = {"max_steps": 4, "save_steps": 1, "keep_checkpoints": 10}
    _, states = run_jobs_on_two_ranks([
        two_rank_job(tmp_path / "straight", "sage-light", over, train=True),
        two_rank_job(tmp_path / "resumed", "sage-light", {**over, "max_steps": 3}, train=True),
        two_rank_job(tmp_path / "resumed", "sage-light", over, train=True)], timeout=420)
    (s0, s1), _, (r0, r1) = states
    a, b = (read_tracker(tmp_path / d / "tracker") for d in ("straight", "resumed"))
    steps = [sorted(a.prompt_id[a.step == s]) for s in (1, 2, 3, 4)]
    assert steps[2] != steps[0]  # epoch 1's order is not epoch 0's: the test tells them apart
    assert [sorted(b.prompt_id[b.step == s]) for s in (1, 2, 3, 4)] == steps
    assert r0["scheduler"] == r1["scheduler"] == s0["scheduler"] == s1["scheduler"]
    assert global_metrics(r0["history"]) == global_metrics(s0["history"])
