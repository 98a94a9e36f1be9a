"""Run by tests/test_multiprocess.py (and tests/test_vllm.py, with vLLM) under torchrun: SAGE-family training on 2 CPU
processes (gloo). $MP_OVERRIDES: more RunSpec fields, as JSON."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sage_core.presets import preset  # noqa: E402
from sage_core.train import build_trainer, release_vllm, shutdown_distributed  # noqa: E402

out, method = sys.argv[1], sys.argv[2]
spec = preset("tiny-cpu", method=method, difficulty="hard", num_prompts=8, prompts_per_step=4, num_generations=4,
              max_steps=2, max_completion_length=32, save_steps=100,
              **json.loads(os.environ.get("MP_OVERRIDES", "{}")))
trainer = build_trainer(spec, out)
rank = trainer.accelerator.process_index
if os.environ.get("MP_CTX_LIMIT"):  # as vLLM's max_model_len would set it (tests/test_context.py)
    trainer._ctx_limit = int(os.environ["MP_CTX_LIMIT"])
try:
    trainer.train()
except Exception as e:  # which rank failed, and how: the test reads these
    with open(os.path.join(out, f"error_rank{rank}.txt"), "w") as f:
        f.write(f"{type(e).__name__}: {e}")
    raise
with open(os.path.join(out, f"state_rank{rank}.json"), "w") as f:
    json.dump({"scheduler": trainer.scheduler.state(), "seen": sorted(trainer.tracker.seen),
               "solved": sorted(trainer.tracker.solved),
               "history": [{k: v for k, v in h.items() if k.startswith("sage/")} for h in trainer.state.log_history]},
              f)
release_vllm(trainer)
shutdown_distributed()
