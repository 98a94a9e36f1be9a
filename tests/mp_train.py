"""Run by tests/test_multiprocess.py (and tests/test_vllm.py, with vLLM) under torchrun: SAGE-family training on 2 CPU
processes (gloo). $MP_OVERRIDES: more RunSpec fields, as JSON."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trl import GRPOTrainer

from sage_core.presets import preset  # noqa: E402
from sage_core.train import build_trainer, release_vllm, shutdown_distributed  # noqa: E402

out, method = sys.argv[1], sys.argv[2]
spec = preset("tiny-cpu", **{**dict(method=method, difficulty="hard", num_prompts=8, prompts_per_step=4,
                                    num_generations=4, max_steps=2, max_completion_length=32, save_steps=100),
                             **json.loads(os.environ.get("MP_OVERRIDES", "{}"))})
trainer = build_trainer(spec, out)
rank = trainer.accelerator.process_index
if os.environ.get("MP_CTX_LIMIT"):  # as vLLM's max_model_len would set it (tests/test_context.py)
    trainer._ctx_limit = int(os.environ["MP_CTX_LIMIT"])
if os.environ.get("MP_BUCKET_OVERHEAD"):  # per rank, "0,1000000": one rank splits every length, one never splits
    trainer.args.sage_bucket_overhead = int(os.environ["MP_BUCKET_OVERHEAD"].split(",")[rank])
forwards = [0]  # the loss's model forwards on this rank (one per length bucket)
_forward = GRPOTrainer._get_per_token_logps_and_entropies


def _counted(self, *args, **kwargs):
    forwards[0] += 1
    return _forward(self, *args, **kwargs)


GRPOTrainer._get_per_token_logps_and_entropies = _counted
try:
    trainer.train()
except Exception as e:  # which rank failed, and how: the test reads these
    with open(os.path.join(out, f"error_rank{rank}.txt"), "w") as f:
        f.write(f"{type(e).__name__}: {e}")
    raise
with open(os.path.join(out, f"state_rank{rank}.json"), "w") as f:
    json.dump({"scheduler": trainer.scheduler.state(), "seen": sorted(trainer.tracker.seen),
               "solved": sorted(trainer.tracker.solved), "forwards": forwards[0],
               "history": [{k: v for k, v in h.items() if k.startswith("sage/")} for h in trainer.state.log_history]},
              f)
release_vllm(trainer)
shutdown_distributed()
