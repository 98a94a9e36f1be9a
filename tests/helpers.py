"""Helpers shared by test modules (not fixtures: those live in conftest.py).

- `metric(trainer, key)`: a logged metric's values, one per step that logged it.
- `run_two_ranks(out, method, overrides, ...)`: tests/mp_train.py under torchrun on 2 CPU processes (gloo, a free
  loopback port); returns the finished process and each rank's state file.
- `global_metrics(history)`: a rank's log history without its own timings, which is what both ranks must agree on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil

HERE = Path(__file__).parent


def metric(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


def run_two_ranks(out: Path, method: str, overrides: dict | None = None, *, ctx_limit: int | None = None,
                  bucket_overhead: tuple[int, int] | None = None, expect_ok: bool = True, timeout: int = 600):
    """`ctx_limit`: the trainer's generation context limit on both ranks (as vLLM's max_model_len would set it).
    `bucket_overhead`: each rank's sage_bucket_overhead (how readily its loss forward splits into length buckets).
    On a timeout (a hang) the whole process group is killed, ranks included, not only torchrun.
    With expect_ok=False the finished process is returned whatever its exit code, with no state files."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE.parent),
           "MP_OVERRIDES": json.dumps(overrides or {}), "MP_CTX_LIMIT": str(ctx_limit or ""),
           "MP_BUCKET_OVERHEAD": ",".join(map(str, bucket_overhead or ()))}
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", port, str(HERE / "mp_train.py"), str(out), method]
    proc = _run_group(cmd, env, timeout)
    if not expect_ok:
        return proc, None, None
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((out / f"state_rank{r}.json").read_text()) for r in (0, 1))
    return proc, r0, r1


def _run_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run that, when it times out or pytest-timeout interrupts the test, kills the whole process tree:
    torchrun starts each rank in a session of its own, and killing torchrun alone left the ranks waiting in a
    collective."""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(p.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            p.kill()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def global_metrics(history: list[dict]) -> list[dict]:
    """Timings are each process's own; everything else is computed on gathered groups."""
    return [{k: v for k, v in h.items() if not k.endswith("_seconds")} for h in history]


def lora_checkpoint(base_model, spec, out: Path, std: float) -> dict:
    """Save LoRA adapters (spec's lora settings) on `base_model` to `out`, with B drawn from N(0, std) instead of
    peft's zeros so that merging them changes the weights. Returns the adapter tensors by parameter name."""
    import torch
    from peft import get_peft_model

    from sage_core.lora import peft_config

    torch.manual_seed(0)
    model = get_peft_model(base_model, peft_config(spec))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)
    model.save_pretrained(out)
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
