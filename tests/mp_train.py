"""Run by tests/test_multiprocess.py, tests/test_context.py and tests/test_vllm.py under torchrun (tests/helpers.py):
SAGE-family training on 2 CPU processes (gloo), one job after another in the same processes, so that a test module
pays the processes' start (about 10 s on 2 cores) once. $MP_JOBS: a JSON list of jobs, each {"out": folder,
"method": ..., "overrides": more RunSpec fields, "ctx_limit": the generation context limit or null (as vLLM's
max_model_len would set it), "bucket_overhead": [rank 0's, rank 1's] sage_bucket_overhead or null, "train": true to
run it through sage_core.train.train, which resumes from the folder's last checkpoint as `sage train` does}. Each
finished job writes state_rank{r}.json in its folder; a failing job writes error_rank{r}.txt and ends the launch."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trl import GRPOTrainer

from sage_core import shared_prefix  # noqa: E402
from sage_core import train as train_module  # noqa: E402
from sage_core.presets import preset  # noqa: E402
from sage_core.train import build_trainer, release_vllm, shutdown_distributed  # noqa: E402

forwards = [0]  # the loss's forwards on this rank in the current job (one per length bucket, whole or shared prompt)
_forward, _shared_forward = GRPOTrainer._get_per_token_logps_and_entropies, shared_prefix.forward


def _counted(self, *args, **kwargs):
    forwards[0] += 1
    return _forward(self, *args, **kwargs)


def _counted_shared(*args, **kwargs):
    forwards[0] += 1
    return _shared_forward(*args, **kwargs)


GRPOTrainer._get_per_token_logps_and_entropies = _counted
shared_prefix.forward = _counted_shared


def run(out: str, method: str, overrides: dict, ctx_limit: int | None, bucket_overhead: list[int] | None,
        through_train: bool = False) -> None:
    spec = preset("tiny-cpu", **{**dict(method=method, difficulty="hard", num_prompts=8, prompts_per_step=4,
                                        num_generations=4, max_steps=2, max_completion_length=32, save_steps=100),
                                 **overrides})
    if through_train:  # sage_core.train.train builds the trainer (kept here for the state file) and resumes
        built = []
        train_module.build_trainer = lambda *a, **k: built.append(build_trainer(*a, **k)) or built[-1]
        try:
            train_module.train(spec, out)
        finally:
            train_module.build_trainer = build_trainer
        trainer = built[-1]
        write_state(out, trainer)
        return
    trainer = build_trainer(spec, out)
    rank = trainer.accelerator.process_index
    if rank == 0:  # as sage_core.train.train writes it: what a test reads the job's spec from
        with open(os.path.join(out, "spec.json"), "w") as f:
            f.write(spec.model_dump_json())
    if ctx_limit:
        trainer._ctx_limit = ctx_limit
    if bucket_overhead:  # e.g. [0, 10**9]: one rank splits every length, one never splits
        trainer.args.sage_bucket_overhead = bucket_overhead[rank]
    forwards[0] = 0
    try:
        trainer.train()
    except Exception as e:  # which rank failed, and how: the test reads these
        with open(os.path.join(out, f"error_rank{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise
    write_state(out, trainer)
    release_vllm(trainer)


def write_state(out: str, trainer) -> None:
    with open(os.path.join(out, f"state_rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump({"scheduler": trainer.scheduler.state(), "seen": sorted(trainer.tracker.seen),
                   "solved": sorted(trainer.tracker.solved), "forwards": forwards[0],
                   "history": [{k: v for k, v in h.items() if k.startswith(("sage/", "eval/")) or k == "step"}
                               for h in trainer.state.log_history]}, f)


for job in json.loads(os.environ["MP_JOBS"]):
    run(job["out"], job["method"], job.get("overrides") or {}, job.get("ctx_limit"), job.get("bucket_overhead"),
        job.get("train", False))
shutdown_distributed()
