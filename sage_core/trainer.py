"""SageGRPOTrainer: TRL's GRPOTrainer, with collapsed groups re-rolled under hints.

Per training step, for every prompt x of the batch (a group of G rows sharing one prompt_id, always on one process):
  1. roll G completions at level l0 = scheduler.level_before(x)   (0 = no hint; SAGE-LIGHT: the tracked level)
  2. score them with the verifier (the reward never changes)
  3. while scheduler.next_action(x, tries) asks for it: get h = hint(x, level), re-roll G completions of
     pi(.|x,h) for that group only, and score them (SAGE: levels 1, 2, 3 until a success)
     (optionally, when a round holds few groups, the levels after it are rolled in the same pass; a try is kept
     only if next_action, seeing the tries before it, asks for it, so the search and its result are sequential)
  4. scheduler.finalize picks the G rows trained on; their prompt ids are the hinted ones, so the loss is
     on-policy in (x,h); the group's advantages get the selection's weight
Collectives (generation under ZeRO-3, vLLM server mode, reward gathering) see the same calls on every process:
every round gathers the work counts and pads each process to the largest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields, replace

import torch
from accelerate.utils import gather, gather_object
from torch import nn
from transformers import LogitsProcessorList, StoppingCriteriaList, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import RepeatSampler, is_async_callable

from . import gate, shared_prefix
from .atomic import write_text_atomic
from .curation import Weighted
from .data import PromptTooLong
from .generation_cache import generation_cache
from .hint_drafts import HintDrafts
from .hint_prefetch import GreedyRows, Lookahead, StopRowsAt
from .hints import HintContext, HintRequest, HintResult, HintSource, OnlineHints, leaks, request_prompt
from .memory import measured
from .models import config_context
from .packing import prompt_buckets
from .periodic_eval import NoHintEval
from .prompts import LEVELS, hinted_problem
from .reward import completion_text
from .schedulers import Action, Scheduler, make_scheduler
from .tracker import PromptTracker

log = logging.getLogger(__name__)
# generation flags only sampling reads, at transformers' defaults, which greedy decoding takes without a warning: set
# while HF generate decodes greedily (hints), put back after (TRL's top_k=0, and a model's own top_k when unset, made
# generate warn at every run that greedy decoding ignores it)
GREEDY_NEUTRAL = {"top_k": 50, "top_p": 1.0, "min_p": None}
# transformers 5.24 renamed gradient checkpointing to activation checkpointing, the old names warn (FutureWarning);
# 5.17, the newest vLLM 0.31 allows, has only the old ones. The config's field for it is the new name where there is
# one. TRL 1.16 reads the model's old `is_gradient_checkpointing` before every generate call: that warning (shown at
# every step, as something between two steps resets Python's once-per-place registry) is TRL's, and the trainer
# leaves it out (set when a trainer is made: a filter set at import is lost when the import runs in a
# catch_warnings block).
CHECKPOINTING_ARG = next(n for n in ("activation_checkpointing", "gradient_checkpointing")
                         if n in {f.name for f in fields(TrainingArguments)})

POOL_FILE = "sage_prompt_pool.json"  # in a checkpoint: each process's place in its fresh-prompt pool
POOL_SEED_OFFSET = 0x5EED  # the fresh-prompt pool's permutation is seeded apart from the sampler's (_draw_prompt)
RNG_FILE = "sage_scheduler_rng.json"  # in a checkpoint: each process's scheduler generator (pooled subset picks)
STATE_FILE = "sage_replay_state.json"  # in a checkpoint: the scheduler's and tracker's state (the same everywhere)


@dataclass
class SageConfig(GRPOConfig):
    """GRPOConfig plus SAGE's fields only."""

    sage_method: str = field(default="sage", metadata={"help": "grpo | sage | sage-light | curation methods"})
    hint_max_tokens: int = field(default=48, metadata={"help": "max new tokens of one hint"})
    hint_retries: int = field(default=2, metadata={"help": "resamples of a hint that leaked or came back empty"})
    hint_temperature: float = field(default=0.0, metadata={
        "help": "temperature of a hint's first sample (0 = greedy, as the paper's code); resamples use 1.0"})
    light_min: float = field(default=0.1, metadata={"help": "SAGE-LIGHT: raise the level when accuracy <= this"})
    light_max: float = field(default=0.35, metadata={"help": "SAGE-LIGHT: lower the level when accuracy > this"})
    sage_max_rounds: int = field(default=4, metadata={"help": "hard cap on extra rollout rounds per step"})
    sage_lookahead: bool = field(default=False, metadata={
        "help": "roll the scheduler's next actions (SAGE: higher levels) in the same pass when it stays no wider "
                "than the first rollout; the search result is unchanged, unasked rollouts are counted as spent"})
    sage_length_buckets: bool = field(default=True, metadata={
        "help": "run the loss's forward on buckets of rows of similar length, each trimmed of shared padding"})
    sage_skip_zero_advantage: bool = field(default=True, metadata={
        "help": "forward zero-advantage rows without a graph (no backward) when that is exact: beta 0, no entropy "
                "bonus; needs sage_length_buckets (so not under ZeRO-3/FSDP)"})
    sage_shared_prefix: bool = field(default=True, metadata={
        "help": "in the loss's forward, compute each distinct prompt once for the rows that share it (a group's G "
                "rows) and the rows' completions against its cached keys and values: the same log-probs and "
                "gradients; needs sage_length_buckets, a full-attention cache and, for rows with gradients, no "
                "gradient checkpointing (those rows then run whole)"})
    sage_shared_prefill: bool = field(default=True, metadata={
        "help": "HF generate: prefill each distinct prompt once for the rows that repeat it (a group's G rows) and "
                "hand generate their cache; the same logits up to float rounding. Not with vLLM (it caches prefixes "
                "itself), ZeRO-3/FSDP, dropout, beams, a cache_implementation or a cache other than full attention"})
    sage_hint_drafts: bool = field(default=True, metadata={
        "help": "a greedy hint (HF generate) is first checked in one forward against the hint last written for the "
                "same request: a draft greedy decoding would write again needs no decode loop (the same hints)"})
    sage_hint_prefetch: bool = field(default=False, metadata={
        "help": "online greedy hints on HF generate with sage_hint_drafts: the next batch's hint requests are decoded "
                "greedily in this step's rollout pass, as their drafts (sage_core.hint_prefetch); the next step "
                "checks them in one forward (the same hints, fewer decode loops). For GPUs, where rows added to a "
                "pass cost little (not measured there yet); on CPU it costs more than it saves"})
    sage_bucket_overhead: int | None = field(default=None, metadata={
        "help": "a forward's fixed cost in token slots: a bucket is split off only when it saves more padding. None: "
                "256 on CPU (measured), 2048 on CUDA (an estimate, not measured). With ZeRO-3/FSDP there are no "
                "buckets: the bucket count differs between ranks, and each forward gathers parameters collectively"})
    sage_measure_activations: bool = field(default=False, metadata={
        "help": "log sage/activation_mb, the bytes the loss's forward saves for backward per micro-batch (a saved-"
                "tensor hook; off by default so it never meets torch.compile)"})
    tracker_dir: str | None = field(default=None, metadata={"help": "per-prompt Parquet files (output_dir/tracker)"})
    sage_eval_every: int | None = field(default=None, metadata={
        "help": "every this many optimizer steps (and at the last): no-hint avg@k / pass@k on the trainer's eval_rows, "
                "logged as eval/during/<sage_eval_name>/avg_at_<k> and pass_at_<k> with the step"})
    sage_eval_name: str = field(default="heldout", metadata={"help": "the eval set's name in its metrics"})
    sage_eval_k: int = field(default=4, metadata={"help": "samples per eval prompt"})
    sage_eval_temperature: float = field(default=0.6, metadata={"help": "eval sampling temperature (0 = greedy)"})
    sage_eval_top_p: float = field(default=0.95, metadata={"help": "eval nucleus sampling p"})

    def __post_init__(self):
        super().__post_init__()
        if self.ddp_broadcast_buffers is None and self.sage_length_buckets:
            # each process buckets its own rows, so processes run different numbers of loss forwards; DDP's default
            # broadcast of module buffers at each forward is a collective and would leave them waiting on each
            # other. A causal LM's buffers (rotary frequencies) are the same on every process: nothing to broadcast
            self.ddp_broadcast_buffers = False
        elif self.ddp_broadcast_buffers and self.sage_length_buckets:
            raise ValueError("ddp_broadcast_buffers=True makes every forward a collective, and with "
                             "sage_length_buckets processes run different numbers of forwards (they would wait "
                             "forever): set sage_length_buckets=False to broadcast buffers")
        local = self.per_device_train_batch_size * self.steps_per_generation
        if local % self.num_generations:
            raise ValueError(
                f"per-process generation batch ({self.per_device_train_batch_size} x {self.steps_per_generation} "
                f"steps_per_generation = {local}) must be a multiple of num_generations ({self.num_generations}) "
                "so that every prompt group lives on one process"
            )
        if self.tracker_dir is None:
            self.tracker_dir = f"{self.output_dir}/tracker"


@dataclass
class Try:
    """G rollouts of one prompt at one level."""

    level: int
    hint: str | None
    rows: list[dict]  # dataset rows (the prompt's columns), one per rollout
    prompt_ids: list
    completion_ids: list
    completions: list
    logprobs: list | None
    rpf: torch.Tensor  # (G, n_reward_funcs)
    rewards: list[float]
    extra: dict[str, list] = field(default_factory=dict)  # the reward functions' log_extra columns, one per rollout


class SageGRPOTrainer(NoHintEval, GRPOTrainer):
    _prefetch_ids: Sequence[list[int]] = ()  # hint requests the first rollout pass writes drafts for (per step)

    def __init__(self, *args, scheduler: Scheduler | None = None, hint_source: HintSource | None = None,
                 eval_rows: list[dict] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        a = self.args
        # normalize_then_sum divides each group by its std whatever scale_rewards says (then the batch by a constant)
        scaling = "group" if a.multi_objective_aggregation == "normalize_then_sum" else a.scale_rewards
        self.scheduler = scheduler or make_scheduler(a.sage_method, light_min=a.light_min, light_max=a.light_max,
                                                     max_rounds=a.sage_max_rounds, scale_rewards=scaling)
        weighted_for = getattr(self.scheduler, "scale_rewards", scaling)
        if getattr(self.scheduler, "objective", "none") != "none" and (weighted_for == "group") != (
                scaling == "group"):  # its weights (h S_ref / S_sel) are made for the other advantages
            raise ValueError(f"the scheduler weights groups for scale_rewards={weighted_for!r} but the trainer scales "
                             f"advantages with scale_rewards={a.scale_rewards!r}"
                             f"{' (per group: normalize_then_sum)' if scaling != a.scale_rewards else ''}: build it "
                             f"with make_scheduler(..., scale_rewards={scaling!r})")
        if hasattr(self.scheduler, "seed_process"):  # a pooled method's subset picks: a generator per process
            self.scheduler.seed_process(self.accelerator.process_index)
        self.hint_source = hint_source or OnlineHints()
        self.tracker = PromptTracker(a.tracker_dir, write=self.accelerator.is_main_process)
        if a.sage_bucket_overhead is None:
            a.sage_bucket_overhead = _bucket_overhead(self)
        self._sharded = _params_sharded(self)  # ZeRO-3/FSDP: the loss's forward runs TRL's own loop (no buckets)
        if any(isinstance(f, nn.Module) for f in self.reward_funcs):
            raise ValueError("SageGRPOTrainer scores re-rolls locally: reward_funcs must be Python callables")
        if self.tools:
            raise ValueError("SageGRPOTrainer does not re-roll tool-calling rollouts; pass tools=None")
        # TRL runs these for its one rollout of a batch; the re-rolls, the hints and the no-hint eval are generate
        # calls of this trainer's own (_roll), which would bypass them: a step would mix the custom rollouts with
        # plain ones, and an environment's get_reward would score re-rolls without their environments
        if self.rollout_func is not None:
            raise ValueError("SageGRPOTrainer generates its re-rolls and hints itself, without a rollout_func; pass "
                             "rollout_func=None (or train with TRL's GRPOTrainer)")
        if self.environment_factories is not None:
            raise ValueError("SageGRPOTrainer does not re-roll rollouts in environments; pass environment_factory=None")
        self._rows: list[dict] | None = None
        self._final_rpf: torch.Tensor | None = None
        self._row_weights: torch.Tensor | None = None
        self._hints_prepared = False
        self._pool = None  # fresh prompts for methods that swap a collapsed group for a new prompt
        self._pool_pos = 0  # draws made from it (a resumed run starts from its checkpoint's, see restore_state)
        self._batch_ids: set[str] = set()  # the step's prompt ids on every process (methods that swap prompts)
        self._no_grad_rows: torch.Tensor | None = None  # rows of the current loss forward that carry no gradient
        self._share_failed = False  # the model's cache cannot serve a shared prompt (sage_shared_prefix)
        self._prefill_failed = False  # nor can generate's (sage_shared_prefill)
        self._hint_drafts: HintDrafts | None = None  # each greedy hint request's last hint (sage_hint_drafts)
        self._lookahead: Lookahead | None = None  # the epoch's batches, read ahead for the next step (prefetch)
        self._ctx_limit: int | None | bool = False  # vLLM's context in tokens (None: unknown); False: not read yet
        self._init_no_hint_eval(eval_rows)

    # ------------------------------------------------------------------------------------------ TRL hooks
    def _get_train_sampler(self, dataset=None):
        """TRL's sampler, made to give epoch e the same prompt order whether the run got there in one go or was
        resumed from a checkpoint (see EpochSampler)."""
        s = super()._get_train_sampler(dataset)
        if not isinstance(s, RepeatSampler):
            return s
        self._epoch_sampler = EpochSampler(s.data_source, s.mini_repeat_count, s.batch_size, s.repeat_count, s.shuffle,
                                           s.seed)
        return self._epoch_sampler

    def _run_epoch(self, *args, **kwargs):
        """HF's epoch, with the sampler told its epoch first: accelerate's set_epoch does not reach it through the
        batches skipped on a resume mid-epoch when the batch sampler is sharded over processes
        (SkipBatchSampler(BatchSamplerShard(BatchSampler(sampler)))), and a resumed run on several processes rolled
        out the first epoch's prompt order again."""
        if (sampler := getattr(self, "_epoch_sampler", None)) is not None and "epoch" in kwargs:
            sampler.set_epoch(kwargs["epoch"])
        self._train_dataloader = kwargs.get("train_dataloader")  # the next epoch's first batch (_next_epoch_batch)
        return super()._run_epoch(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """HF's, reading the epoch's batches ahead by one generation (steps_per_generation x num_iterations
        batches) where hints are prefetched: the next step's rows (Lookahead.next_other)."""
        if not self._prefetch_wanted():
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._lookahead is None or self._lookahead.source is not epoch_iterator:
            self._lookahead = Lookahead(epoch_iterator)
        out = super().get_batch_samples(self._lookahead, num_batches, device)
        self._lookahead.fill(self.args.steps_per_generation * self.num_iterations)
        return out

    def _generate_and_score_completions(self, inputs):
        self._rows = inputs if self.model.training else None
        try:
            out = super()._generate_and_score_completions(inputs)
            if self._row_weights is not None:
                out["advantages"] = out["advantages"] * self._row_weights.to(out["advantages"].device).view(
                    -1, *([1] * (out["advantages"].dim() - 1)))
            return out
        finally:
            self._rows, self._final_rpf, self._row_weights = None, None, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self._final_rpf is not None:  # already scored while deciding the re-rolls: gather, don't re-verify
            rpf, self._final_rpf = self._final_rpf, None
            return gather(rpf.to(self.accelerator.device))
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _compute_loss(self, model, inputs):
        """TRL's loss; rows whose advantage is 0 carry no gradient when beta = 0 and there is no entropy bonus (every
        loss type multiplies the advantage), so their forward runs without a graph: their log-probs and entropies
        are still computed (the logged entropy and clip ratios cover every row), their backward is skipped."""
        adv = inputs["advantages"]
        exact = self.beta == 0.0 and not self._entropy_bonus_enabled and model.training
        self._no_grad_rows = ((adv == 0) if adv.dim() == 1 else (adv == 0).all(dim=1)) if (
            exact and self.args.sage_skip_zero_advantage) else None
        try:
            compute = super()._compute_loss
            if self.args.sage_measure_activations:
                compute = measured(compute, self._metrics["train"])
            return compute(model, inputs)
        finally:
            self._no_grad_rows = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's forward, on buckets of rows of similar length, each trimmed of the padding all its rows share
        (sage_core.packing), zero-advantage rows in buckets of their own run without a graph (see _compute_loss);
        where rows share a prompt (a group's G rows), a bucket computes it once and each row's completion against its
        cache (sage_core.shared_prefix) when that costs fewer token slots; the log-probs and entropies come back in
        row order, in the same (B, C) shape."""
        # sharded parameters: bucket counts depend on each rank's rows, and a rank running one forward more than
        # another would wait forever in that forward's parameter all-gather; TRL's loop runs the same count
        plain = (not self.args.sage_length_buckets or compute_aux_loss or input_ids.size(0) < 2
                 or any(v is not None for v in multimodal.values()) or self._sharded)
        if plain:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, compute_aux_loss,
                                                              **multimodal)
        C = logits_to_keep
        P = input_ids.size(1) - C
        cols = torch.arange(1, max(P, C) + 1, device=input_ids.device)
        prompt_w = (attention_mask[:, :P].flip(1) * cols[:P]).amax(1) if P else torch.zeros_like(input_ids[:, 0])
        if P and _absolute_positions(model):  # a row's positions are its columns: buckets keep the left padding
            prompt_w = torch.full_like(prompt_w, P)
        comp_w = (attention_mask[:, P:] * cols[:C]).amax(1)
        dead = self._no_grad_rows
        dead = dead.tolist() if dead is not None and len(dead) == input_ids.size(0) else [False] * input_ids.size(0)
        grad = torch.is_grad_enabled()
        sharing = self.args.sage_shared_prefix and not self._share_failed and P > 1 and not _multimodal(self.model)
        share = {g: sharing and shared_prefix.usable(model, g) for g in {grad, False}}  # with gradients or without
        buckets = []  # (rows, with_grad, shared prompt)
        for no_grad in (False, True):
            rows = [i for i, d in enumerate(dead) if d == no_grad]
            if not rows:
                continue
            shares = share[grad and not no_grad]
            groups = shared_prefix.prompt_groups(input_ids[rows, :P], attention_mask[rows, :P]) if shares else rows
            # batch_size: TRL's memory cap on rows per forward, a bucket's most rows
            for b, shared in prompt_buckets(prompt_w[rows].tolist(), comp_w[rows].tolist(), groups,
                                            self.args.sage_bucket_overhead, shares, max_rows=batch_size):
                buckets.append(([rows[i] for i in b], not no_grad, shared))
        if grad and not buckets[0][1]:  # no row carries gradient: one bucket keeps the loss on the graph
            buckets[0] = (buckets[0][0], True, buckets[0][2] and share[grad])
        logps, entropies = [], []
        for rows, with_grad, shared in buckets:
            idx = torch.tensor(rows, device=input_ids.device)
            pw, cw = int(prompt_w[idx].max()), max(int(comp_w[idx].max()), 1)
            ids, mask = input_ids[idx, P - pw:P + cw], attention_mask[idx, P - pw:P + cw]
            with torch.set_grad_enabled(with_grad and grad):
                lp = None
                if shared and pw > 1:
                    try:
                        lp, ent = shared_prefix.forward(model, ids, mask, cw, compute_entropy,
                                                        self.accelerator.autocast)
                    except shared_prefix.CacheUnsupported as e:
                        log.warning("the loss's forward computes every row's prompt: the model's cache is %s, not "
                                    "full-attention layers (sage_shared_prefix)", e)
                        self._share_failed = True
                if lp is None:
                    lp, ent, _ = super()._get_per_token_logps_and_entropies(model, ids, mask, cw, None,
                                                                            compute_entropy)
            logps.append(nn.functional.pad(lp, (0, C - cw)))
            if compute_entropy:
                entropies.append(nn.functional.pad(ent, (0, C - cw)))
        back = torch.argsort(torch.tensor([r for b, _, _ in buckets for r in b], device=input_ids.device))
        return (torch.cat(logps)[back], torch.cat(entropies)[back] if compute_entropy else None, None)

    def _generate(self, prompts):
        if self._rows is None:
            return super()._generate(prompts)
        return self._sage_generate(prompts, self._rows)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generate, after a check every process makes together: vLLM rejects a prompt that does not fit its
        context, and one rank failing alone would leave the others waiting in the next collective forever. The
        colocated engine refuses a prompt that fills the whole context (it cuts the completion short instead); a
        server refuses one that leaves no room for max_tokens new tokens (vllm/renderers/params.py
        _token_len_check: TRL sends max_tokens=max_completion_length), and rank 0 alone would get its HTTP 400."""
        if (limit := self._context_limit()) is not None:
            longest = max(gather_object([max((len(p) for p in prompt_ids), default=0)]))
            server = getattr(getattr(self, "vllm_generation", None), "mode", None) == "server"
            room = self._max_new_tokens() if server else 1
            if longest + room > limit:
                raise PromptTooLong(
                    f"a prompt of {longest} tokens does not fit vLLM's context of {limit} tokens (max_model_len)"
                    + (f" with the {room} new tokens a server must have room for (max_completion_length)"
                       if server else "") + "; set max_prompt_length (longer rows are then left out at load and the "
                    "context is sized for the rest) or raise it")
        multimodal = bool(multimodal_fields) or any(im is not None for im in images or [])
        extra, self._prefetch_ids = ([] if multimodal else list(self._prefetch_ids)), []
        n = len(prompt_ids)
        with self._shared_prefill(multimodal), self._greedy_tail(n) if extra else nullcontext():
            out = super()._generate_single_turn(list(prompt_ids) + extra if extra else prompt_ids, images,
                                                multimodal_fields, num_generations, has_tool_images)
        if not extra:
            return out
        completion_ids, logprobs = out
        drafts = self._hint_drafts
        for ids, hint in zip(extra, completion_ids[n:], strict=True):
            drafts.remember(ids, hint[:self.args.hint_max_tokens])
        self._counts["hint_prefetch_rows"] += len(extra)
        return completion_ids[:n], (logprobs[:n] if logprobs is not None else None)

    @contextmanager
    def _greedy_tail(self, first: int):
        """While TRL's HF generate runs: the rows from `first` on (hint requests, sage_core.hint_prefetch) decode
        greedily and stop at hint_max_tokens. The instance's `generate` is wrapped for the call and restored."""
        model = self.accelerator.unwrap_model(self.model_wrapped)
        inner = model.generate

        def generate(*args, **kwargs):
            width = kwargs["input_ids"].size(1)
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []),
                                                              GreedyRows(first)])
            stop = StopRowsAt(first, width, self.args.hint_max_tokens)
            kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), stop])
            return inner(*args, **kwargs)

        with _generate_replaced(model, generate):
            yield

    @contextmanager
    def _shared_prefill(self, multimodal: bool):
        """While TRL's HF generate runs: hand it a cache of the batch's prompts, each distinct prompt computed once
        (sage_core.generation_cache; a group's G rows hold one prompt), so that generate's own prefill runs each
        row's last prompt token only, and decode steps append to the cache in place. The instance's `generate` is
        wrapped for the call and restored."""
        if self.use_vllm or not self.args.sage_shared_prefill or self._prefill_failed or self._sharded or multimodal:
            yield
            return
        model = self.accelerator.unwrap_model(self.model_wrapped)

        def setting(name):  # generate fills what TRL's config leaves unset from the model's own
            value = getattr(self.generation_config, name, None)
            return getattr(model.generation_config, name, None) if value is None else value

        if (_multimodal(model) or (setting("num_beams") or 1) > 1 or (setting("num_return_sequences") or 1) > 1
                or setting("cache_implementation") is not None or _dropout_active(model)):
            yield
            return
        plain = model.generate
        name = shared_prefix.cache_kwarg(model)

        def generate(*args, **kwargs):
            ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
            if args or ids is None or mask is None or set(kwargs) - {"input_ids", "attention_mask", "generation_config",
                                                                      "logits_processor", "stopping_criteria"}:
                return plain(*args, **kwargs)
            conf = kwargs.get("generation_config") or model.generation_config
            new = conf.max_new_tokens
            if new is None:  # a growth hint only: the cache's buffer doubles past it
                new = max((conf.max_length or 0) - ids.size(1), 0)
            try:
                cache = generation_cache(model, ids, mask, new)
            except shared_prefix.CacheUnsupported as e:
                self._prefill_failed = True
                log.warning("generate prefills every row: the model's cache is %s, not full-attention layers "
                            "(sage_shared_prefill)", e)
                cache = None
            return plain(**kwargs) if cache is None else plain(**kwargs, **{name: cache})

        with _generate_replaced(model, generate):
            yield

    def _context_limit(self) -> int | None:
        """vLLM's max_model_len: the configured one, else the engine's (colocate) or the server's (its /v1/models,
        read by the main process, the one that holds the client); None without vLLM. The first call must come from
        every process together (it may gather): the step's start and every generate call make it."""
        if self._ctx_limit is False:
            gen = getattr(self, "vllm_generation", None) if self.use_vllm else None
            limit = getattr(gen, "max_model_length", None)
            if limit is None and getattr(gen, "llm", None) is not None:
                limit = gen.llm.model_config.max_model_len
            elif limit is None and getattr(gen, "mode", None) == "server":
                client = getattr(gen, "vllm_client", None)
                served = _served_context(client.base_url) if client is not None else None
                limit = next((x for x in gather_object([served]) if x), None)
            self._ctx_limit = limit
        return self._ctx_limit

    def _request_context(self) -> int | None:
        """The context a hint request and its hint must fit: vLLM's (_context_limit), else (HF generate) the
        policy's max_position_embeddings. HF generate does not stop at it: a request with a long reference solution
        ran past it (torch's 'index out of range' on learned positions, hints written from positions the model never
        saw on rotary ones). Training prompts are checked against it before training (train.check_context)."""
        limit = self._context_limit()
        return limit if limit is not None else config_context(self.model.config)

    # ------------------------------------------------------------------------------------------ the step
    def _sage_generate(self, prompts, rows):
        G, t_start, m = self.num_generations, time.perf_counter(), self._metrics["train"]
        self._hint_seconds, self._counts, self._unasked = 0.0, defaultdict(float), defaultdict(int)
        self._passes = defaultdict(int)  # sequential generate calls this step, by kind (reroll, hint)
        self._context_limit()  # read once, on every process together, before any hint request is measured
        groups = _groups_by_prompt_id(rows, G)
        self._batch_ids: set[str] = set()
        if getattr(self.scheduler, "swaps_prompts", False):  # the same on every process: a collective for all
            self._batch_ids = {pid for ids in gather_object([[pid for pid, _ in groups]]) for pid in ids}
        if not self._hints_prepared:
            self._prepare_hints()

        # 1-2. first rollout of every group at the scheduler's level, scored
        levels = {pid: self.scheduler.level_before(pid) for pid, _ in groups}
        hints = self._get_hints([(rows[idx[0]], lvl) for pid, idx in groups if (lvl := levels[pid]) > 0])
        while self.scheduler.uses_hints:  # a level whose hint failed (leaked, missing): the next usable one down
            down = [(pid, idx) for pid, idx in groups if levels[pid] > 1 and hints[pid, levels[pid]].text is None]
            if sum(gather_object([len(down)])) == 0:  # every process asks as many times (hint passes are collective)
                break
            for pid, _ in down:
                levels[pid] -= 1
            hints.update(self._get_hints([(rows[idx[0]], levels[pid]) for pid, idx in down]))
        first_prompts, first_hint = [], {}
        for pid, idx in groups:
            res = hints.get((pid, levels[pid]))
            text = res.text if res is not None else None
            if levels[pid] > 0 and text is None:
                levels[pid] = 0  # no usable hint at any level up to the tracked one: roll without one
            first_hint[pid] = text
            first_prompts += [self._prompt(rows[i], text) for i in idx]
        self._prefetch_ids = self._prefetch_requests(rows)
        try:
            out = super()._generate(first_prompts)
        finally:
            self._prefetch_ids = []
        prompt_ids, completion_ids, _, completions, logprobs, extra, images, tool_images = out
        self._counts["gen_tokens"] += sum(len(c) for c in completion_ids)
        rpf = self._score(rows, first_prompts, completions, completion_ids, extra=(extra_cols := {}))
        tries: dict[str, list[Try]] = {}
        for pid, idx in groups:
            # the try keeps copies: _finalize writes a swapped-in prompt into the batch's own row dicts
            tries[pid] = [self._make_try(levels[pid], first_hint[pid], [dict(rows[i]) for i in idx],
                                         [prompt_ids[i] for i in idx], [completion_ids[i] for i in idx],
                                         [completions[i] for i in idx],
                                         [logprobs[i] for i in idx] if logprobs is not None else None, rpf[idx],
                                         {c: [v[i] for i in idx] for c, v in extra_cols.items()})]
        hint_log = {pid: _no_hint_log() for pid, _ in groups}
        for (pid, lvl), res in hints.items():
            _log_hint(hint_log[pid], lvl, res)

        # 3. further rounds, only for the groups the scheduler asks about (with what it would ask next, if cheap)
        for _ in range(self.args.sage_max_rounds):
            chains = {}
            for pid, _ in groups:
                if (a := self.scheduler.next_action(pid, _seen(tries[pid]))) is not None:
                    chains[pid] = [a]
            if sum(gather_object([len(chains)])) == 0:
                break
            if self.args.sage_lookahead:
                self._look_ahead(chains, tries, width=len(rows))
            self._reroll(chains, tries, hint_log)

        # 4. the trained group of each prompt
        new_ids, new_comp, new_completions, new_lp, weights, final_rpf = self._finalize(groups, tries, rows)
        self._final_rpf = final_rpf
        self._counts["train_tokens"] += sum(len(p) + len(c) for p, c in zip(new_ids, new_comp, strict=True))
        self._row_weights = weights if bool((weights != 1).any()) else None
        self._record(groups, tries, hint_log, rows)
        # wall time is the slowest process's; scheduler statistics are averaged over processes
        gen_s, hint_s = zip(*gather_object([(time.perf_counter() - t_start - self._hint_seconds, self._hint_seconds)]))
        m["sage/gen_seconds"].append(max(gen_s))
        m["sage/hint_seconds"].append(max(hint_s))
        # this process's counts, summed over processes
        # (TRL's own num_tokens and completions/* metrics describe the step's first rollout, not the trained rows)
        for key in ("reroll_groups", "reroll_rows", "hint_rows", "lookahead_unasked_rows", "gen_tokens",
                    "train_tokens", "hint_requests_too_long", "hints_cut", "hints_special_removed", "hint_draft_rows",
                    "hint_drafts_done", "hint_prefetch_rows"):
            m[f"sage/{key}"].append(float(sum(gather_object([self._counts[key]]))))
        # sequential generation passes (the first rollout, re-roll rounds, hint calls): with vLLM a pass costs about
        # its longest completion whatever its width, so these, not the rows, set a step's rollout time there
        m["sage/rollout_passes"].append(float(1 + self._passes["reroll"]))
        m["sage/hint_passes"].append(float(self._passes["hint"]))
        for k, v in scheduler_metrics(self.scheduler).items():
            m[f"sage/{k}"].append(v)
        return new_ids, new_comp, None, new_completions, new_lp, extra, images, tool_images

    def _make_try(self, level, hint, rows, prompt_ids, completion_ids, completions, logprobs, rpf,
                  extra=None) -> Try:
        rewards = (rpf * self.reward_weights.to(rpf.device)).nansum(dim=1).tolist()
        return Try(level, hint, rows, prompt_ids, completion_ids, completions, logprobs, rpf, rewards, extra or {})

    def _look_ahead(self, chains: dict[str, list[Action]], tries: dict[str, list[Try]], width: int) -> None:
        """Extend each group's action with the ones the scheduler would take next if it fails again (SAGE: the
        higher levels), as deep as the round stays within `width` rows (the step's first rollout). Late rounds of a
        level search hold few groups; where a pass's time is set by its decode steps rather than its rows (vLLM:
        16 long rollouts take about as long as 128), rolling levels 2 and 3 together saves a rollout pass and a
        hint pass. Where rows cost time in proportion (HF generate on CPU), the unasked rows cost more than the
        pass saved: off by default (`sage_lookahead`)."""
        G = self.num_generations
        ahead = {pid: self.scheduler.lookahead(pid, _seen(tries[pid]), chain[0]) for pid, chain in chains.items()}
        depth = max((len(a) for a in ahead.values()), default=0)
        while depth and G * sum(1 + min(depth, len(a)) for a in ahead.values()) > width:
            depth -= 1
        for pid, a in ahead.items():
            chains[pid] += a[:depth]

    def _reroll(self, chains: dict[str, list[Action]], tries: dict[str, list[Try]], hint_log) -> None:
        """One more pass of G rollouts for each action of each group in `chains` (every process calls this
        together), then the tries are handed back in order: a try after a group's first action is kept only if the
        scheduler, seeing the tries before it, asks for it (the search is the sequential one; unasked rows count
        as spent, not trained)."""
        G, n_funcs = self.num_generations, len(self.reward_funcs)
        # not a prompt of this step on any process (the batch's ids, gathered at the step's start)
        fresh, taken = {}, {t.rows[0]["prompt_id"] for ts in tries.values() for t in ts} | self._batch_ids
        for pid, chain in list(chains.items()):
            if chain[0].mode == "new_prompt":
                row = self._draw_prompt(taken)
                if row is None:  # the train set has no prompt left outside this batch: keep the group
                    del chains[pid]
                    continue
                fresh[pid] = row
                taken.add(row["prompt_id"])
        row_of = {pid: fresh.get(pid) or tries[pid][-1].rows[0] for pid in chains}
        hints = self._get_hints([(row_of[pid], a.level) for pid, chain in chains.items() for a in chain if a.level])
        made: dict[str, list] = {pid: [None] * len(chain) for pid, chain in chains.items()}
        plan, batch = [], []
        for pid, chain in chains.items():
            row = row_of[pid]
            for k, a in enumerate(chain):
                res = hints.get((row["prompt_id"], a.level)) if a.level > 0 else None
                if a.level > 0 and (res is None or res.text is None):
                    # no usable hint at this level: an empty try, the scheduler moves on
                    made[pid][k] = (Try(a.level, None, [row] * G, [], [], [], None, torch.zeros(0, n_funcs), []), res)
                    continue
                text = res.text if res is not None else None
                plan.append((pid, k, a.level, text, row, res))
                batch += [self._prompt(row, text)] * G
        ids, comp_ids, comps, lps = self._roll(batch)
        rows_flat = [p[4] for p in plan for _ in range(G)]
        rpf = self._score(rows_flat, batch, comps, comp_ids, extra=(extra := {})) if batch else None
        for j, (pid, k, level, text, row, res) in enumerate(plan):
            s = slice(j * G, (j + 1) * G)
            made[pid][k] = (self._make_try(level, text, [row] * G, ids[s], comp_ids[s], comps[s],
                                           lps[s] if lps is not None else None, rpf[s],
                                           {c: v[s] for c, v in extra.items()}), res)
        self._counts["reroll_groups"] += len(plan)
        for pid, chain in chains.items():
            for k, (a, (t, res)) in enumerate(zip(chain, made[pid], strict=True)):
                if k and self.scheduler.next_action(pid, _seen(tries[pid])) != a:
                    unasked = sum(len(u.rewards) for u, _ in made[pid][k:])
                    self._unasked[pid] += unasked
                    self._counts["lookahead_unasked_rows"] += unasked
                    break
                if res is not None:
                    _log_hint(hint_log[pid], a.level, res)
                tries[pid].append(t)

    def _finalize(self, groups, tries, rows):
        """Splice each prompt's selected rows into the batch; returns per-row outputs, weights and rewards."""
        G, n = self.num_generations, len(rows)
        ids, comp_ids, comps, lps = [None] * n, [None] * n, [None] * n, [None] * n
        weights, rpf = torch.ones(n), torch.zeros(n, len(self.reward_funcs))
        extra: dict[str, list] = {}  # log_extra columns of the trained rows, for TRL's completions table
        self._selections, observed = {}, []
        for pid, idx in groups:
            ts = tries[pid]
            sel = self.scheduler.finalize(pid, _seen(ts))
            if len(sel.picks) != G:
                raise RuntimeError(f"scheduler {self.scheduler.name} picked {len(sel.picks)} rows, expected {G}")
            for slot, (ti, ri) in zip(idx, sel.picks, strict=True):
                t = ts[ti]
                ids[slot], comp_ids[slot], comps[slot] = t.prompt_ids[ri], t.completion_ids[ri], t.completions[ri]
                lps[slot] = t.logprobs[ri] if t.logprobs is not None else None
                rpf[slot], weights[slot] = t.rpf[ri], sel.weight
                for c, v in t.extra.items():
                    extra.setdefault(c, [None] * n)[slot] = v[ri]
                if t.rows[ri]["prompt_id"] != rows[slot]["prompt_id"]:  # a swapped-in prompt replaces the row
                    rows[slot].clear()
                    rows[slot].update(t.rows[ri])
            self._selections[pid] = sel
            trained_id = rows[idx[0]]["prompt_id"]  # its pilot: its own first try (a swapped-in prompt's too)
            pilot = next(t for t in ts if t.rows[0]["prompt_id"] == trained_id).rewards
            observed.append((trained_id, ts[sel.picks[0][0]].level, [ts[ti].rewards[ri] for ti, ri in sel.picks],
                             pilot))
        # every process replays every group's outcome, so scheduler state stays identical across processes
        for pid, level, rewards, pilot in gather_object(observed):
            self.scheduler.observe(pid, level, rewards, pilot)
        for c, v in extra.items():  # TRL's _calculate_rewards, which would have logged them, does not run this step
            self._pending_extra_logs[c].extend(v)
        return ids, comp_ids, comps, (None if all(x is None for x in lps) else lps), weights, rpf

    # ------------------------------------------------------------------------------------------ pieces
    def _prompt(self, row: dict, hint: str | None):
        """The policy prompt for a row: its own prompt with the last user turn's problem extended by the hint."""
        prompt = row["prompt"]
        if not hint:
            return prompt
        if isinstance(prompt, str):
            return hinted_problem(prompt, hint)
        msgs = [dict(m) for m in prompt]
        last = max(i for i, msg in enumerate(msgs) if msg["role"] == "user")
        msgs[last]["content"] = hinted_problem(msgs[last]["content"], hint)
        return msgs

    def _score(self, rows, prompts, completions, completion_ids, extra: dict | None = None) -> torch.Tensor:
        """Rewards per function for local rows, with no cross-process gather. The reward functions get what TRL's
        _calculate_rewards gives them: a scalar they log (log_metric) is TRL's, averaged over the step's scoring
        passes (first rollout and re-rolls); the columns they log (log_extra, one value per row) go into `extra`,
        which _finalize selects from for the trained rows (the completions table TRL logs), else nowhere."""
        rpf = torch.zeros(len(rows), len(self.reward_funcs))
        if not rows:
            return rpf
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [r.get(k) for r in rows] for k in keys}
        cols: dict[str, list] = defaultdict(list)
        kwargs.update(trainer_state=self.state, log_extra=lambda column, values: cols[column].extend(values),
                      log_metric=self._log_metric)
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names, strict=True)):
            out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            if is_async_callable(func):  # on TRL's event loop, as TRL runs its async reward functions
                out = asyncio.run_coroutine_threadsafe(out, self.async_loop).result()
            out = list(out)
            if len(out) != len(rows):
                raise ValueError(f"The reward function '{name}' returned {len(out)} rewards, but {len(rows)} were "
                                 "expected (one per prompt-completion pair)")
            rpf[:, i] = torch.tensor([torch.nan if r is None else float(r) for r in out])
        for column, values in cols.items():
            if len(values) != len(rows):
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values, but {len(rows)} were expected "
                                 "(one per prompt-completion pair, from one reward function)")
        if extra is not None:
            extra.update(cols)
        return rpf

    def _roll(self, prompts: list, kind: str = "reroll"):
        """Generate one completion per prompt; every process generates the same count (padded). A hint request
        that leaves no room for the hint in the context (_request_context: vLLM's, or the policy's; a long reference
        solution) is not sent: it comes back empty, as a hint that failed, and the scheduler moves on."""
        ids = list(self._tokenize_prompts(prompts)[0]) if prompts else []
        sent = list(range(len(ids)))
        if kind == "hint" and ids and (limit := self._request_context()) is not None:
            sent = [i for i in sent if len(ids[i]) + self._max_new_tokens() <= limit]
            self._counts["hint_requests_too_long"] += len(ids) - len(sent)
        n = len(sent)
        comp_ids, lps, known = [[] for _ in ids], None, {}  # known: a hint's first tokens, settled by its draft
        drafts = self._greedy_hint_drafts() if kind == "hint" else None
        if drafts is not None and sent:
            checked = drafts.check(self.model, [ids[i] for i in sent], self._max_new_tokens())
            self._counts["hint_draft_rows"] += sum(c is not None for c in checked)
            for i, c in zip(list(sent), checked, strict=True):
                if c is not None and c[1]:  # the draft is the greedy hint: no decoding
                    comp_ids[i] = c[0]
                    sent.remove(i)
                    self._counts["hint_drafts_done"] += 1
                elif c is not None:
                    known[i] = c[0]
        most = max(gather_object([len(sent)]))
        if most:
            self._passes[kind] += 1  # a generate call on every process (the same count everywhere)
            batch = [ids[i] + known.get(i, []) for i in sent]
            pad = batch[0] if batch else self._tokenize_prompts([self._pad_prompt()])[0][0]
            limit = self._max_new_tokens()
            shorter = known and all(i in known for i in sent)  # every row continues a draft (HF generate only)
            with self._sampling(limit - min(len(k) for k in known.values()), 0.0) if shorter else nullcontext():
                out, out_lps = self._generate_single_turn(batch + [pad] * (most - len(sent)), None, {},
                                                          num_generations=1)
            lps = None if out_lps is None else [[] for _ in ids]
            for j, i in enumerate(sent):
                comp_ids[i] = known.get(i, []) + out[j][:limit - len(known.get(i, []))]
                self._counts["gen_tokens"] += len(comp_ids[i]) - len(known.get(i, []))
                if lps is not None:
                    lps[i] = out_lps[j]
        if drafts is not None:
            for i in range(len(ids)):
                if comp_ids[i]:
                    drafts.remember(ids[i], comp_ids[i])
        texts = self.processing_class.batch_decode(comp_ids, skip_special_tokens=True)
        comps = [[{"role": "assistant", "content": t}] for t in texts] if prompts and is_conversational(
            {"prompt": prompts[0]}) else texts
        self._counts[f"{kind}_rows"] += n
        return ids, comp_ids, comps, lps

    def _greedy_hint_drafts(self, sampled: bool = False) -> HintDrafts | None:
        """The hint drafts (sage_core.hint_drafts) when this generate call decodes greedily with nothing changing the
        argmax (no logits processor in TRL's or the model's generation config, no generation_kwargs, no dropout) on
        HF generate with whole parameters; else None (vLLM samples on its own engine; sharded parameters would make
        the check's forward collective). `sampled`: the call samples (a rollout pass), and rows that decode greedily
        in it (GreedyRows) would write greedy decoding's hint."""
        if not self.args.sage_hint_drafts or self.use_vllm or self._sharded:
            return None
        if self.args.generation_kwargs or _argmax_changed(self.generation_config, self.model.generation_config,
                                                          sampled) or _dropout_active(self.model):
            return None
        if self._hint_drafts is None:
            self._hint_drafts = HintDrafts(self.eos_token_ids, self.processing_class.pad_token_id)
        return self._hint_drafts

    def _prefetch_wanted(self) -> bool:
        """Whether the run's hints may be prefetched (sage_core.hint_prefetch): online greedy hints of a
        scheduler that hints, drafts on, HF generate (not its paged batch) with whole parameters. What may change
        from call to call (the generation config, dropout) is checked at each step (_prefetch_requests)."""
        a = self.args
        return bool(a.sage_hint_prefetch and a.sage_hint_drafts and a.hint_temperature == 0
                    and self.scheduler.uses_hints and isinstance(self.hint_source, OnlineHints)
                    and not self.use_vllm and not self._sharded and not getattr(a, "use_transformers_paged", False))

    def _next_epoch_batch(self) -> list[dict]:
        """The next epoch's first batch on this process, drawn from the train dataloader's batch sampler with the
        epoch sampler's generator put back after, so that the epoch draws the same order ([] where the loader is not
        the map-style one TRL builds)."""
        dl, sampler = getattr(self, "_train_dataloader", None), getattr(self, "_epoch_sampler", None)
        batches = getattr(dl, "batch_sampler", None)
        data = getattr(dl, "dataset", None)
        if sampler is None or batches is None or not hasattr(dl, "collate_fn") or not hasattr(data, "__getitem__") \
                or isinstance(data, torch.utils.data.IterableDataset):
            return []
        with sampler.kept():
            first = next(iter(batches), None)
        batch = dl.collate_fn([data[i] for i in first]) if first else []
        return batch if isinstance(batch, list) else []

    def _next_rows(self, rows: list[dict]) -> list[dict]:
        """The next step's rows (this step's are `rows`): the next other batch read ahead, or at the epoch's end the
        next epoch's first; [] where neither is known."""
        nxt = self._lookahead.next_other([r.get("prompt_id") for r in rows])
        return nxt if nxt or not self._lookahead.ended else self._next_epoch_batch()

    def _prefetch_requests(self, rows: list[dict]) -> list[list[int]]:
        """The next step's hint requests (its rows read ahead, each prompt at the level the scheduler holds for it
        now) that fit the context, tokenized: this step's rollout pass writes their drafts. A guess the step's
        outcome changes (a prompt of both steps whose level moves) costs its row only. Requests with a draft are
        written again (a draft one update old is more often the hint), and the run's last step writes the next
        one's as any other: which rows join the pass, and so the rollouts' random draws, depend on the scheduler's
        state and the data order alone, which a checkpoint keeps, not on the drafts, which it does not, nor on
        max_steps, which a resumed run may raise (it then rolls out what one run to the new max_steps would)."""
        if not self._prefetch_wanted() or self._lookahead is None:
            return []
        nxt = self._next_rows(rows)
        drafts = self._greedy_hint_drafts(sampled=True) if nxt else None
        if drafts is None:
            return []
        chats, seen = [], set()
        for r in nxt:
            if r["prompt_id"] not in seen and (level := self.scheduler.level_before(r["prompt_id"])) > 0:
                chats.append(request_prompt(_hint_request(r, level)))
            seen.add(r["prompt_id"])
        if not chats:
            return []
        limit, room = self._request_context(), self.args.hint_max_tokens
        return [list(p) for p in self._tokenize_prompts(chats)[0] if limit is None or len(p) + room <= limit]

    def _max_new_tokens(self) -> int:
        """The current generate length (the hint length while hints are written)."""
        if self.use_vllm:
            return self.vllm_generation.max_completion_length
        return self.generation_config.max_new_tokens

    def _pad_prompt(self):
        return self._rows[0]["prompt"] if self._rows else [{"role": "user", "content": "1"}]

    @contextmanager
    def _sampling(self, max_new_tokens: int, temperature: float, top_p: float | None = None):
        """Hints are short and (by default) greedy, the eval samples at its own temperature and top-p: set them
        while generating, on both back-ends, and restore the rollout settings afterwards."""
        if self.use_vllm:
            gen, new = self.vllm_generation, {"max_completion_length": max_new_tokens, "temperature": temperature}
        else:
            gen = self.generation_config
            new = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
            if temperature > 0:
                new["temperature"] = temperature
            else:  # greedy: the sampling-only flags at their neutral values (GREEDY_NEUTRAL)
                new.update(GREEDY_NEUTRAL)
        if top_p is not None and (self.use_vllm or temperature > 0):  # HF greedy takes none (it warns)
            new["top_p"] = top_p
        old = {k: getattr(gen, k) for k in new}
        for k, v in new.items():
            setattr(gen, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(gen, k, v)

    def _policy_generate(self, chats: list, max_new_tokens: int, temperature: float) -> list[str]:
        with self._sampling(max_new_tokens, temperature):
            _, comp_ids, _, _ = self._roll(chats, kind="hint")
        return self.processing_class.batch_decode(comp_ids, skip_special_tokens=True) if comp_ids else []

    def _hint_context(self) -> HintContext:
        return HintContext(generate=self._policy_generate, max_new_tokens=self.args.hint_max_tokens,
                           retries=self.args.hint_retries, temperature=self.args.hint_temperature,
                           gather=lambda xs: gather_object(xs),
                           rank=self.accelerator.process_index, world=self.accelerator.num_processes)

    def _get_hints(self, asked: list[tuple[dict, int]]) -> dict[tuple[str, int], HintResult]:
        """Hints for (row, level) pairs; called by every process each round, possibly with nothing to ask.
        Only the asked levels are written. Writing SAGE's higher levels ahead (the paper's code writes all three in
        one call) made each pass as long as its level-3 hint and cost more than it saved on tiny-cpu."""
        if not self.scheduler.uses_hints:
            return {}
        t0 = time.perf_counter()
        reqs = [_hint_request(r, lvl) for r, lvl in asked]
        results = [self._cut_hint(q, res) for q, res in zip(reqs, self.hint_source.get(reqs, self._hint_context()),
                                                           strict=True)]
        self._hint_seconds += time.perf_counter() - t0
        return {(q.prompt_id, q.level): res for q, res in zip(reqs, results, strict=True)}

    def _cut_hint(self, req: HintRequest, res: HintResult) -> HintResult:
        """A hint longer than hint_max_tokens (a teacher's, or a hints file's) is cut to that many tokens: vLLM's
        context has room for that much hint. Text of the policy tokenizer's special tokens (a teacher's `<|im_end|>`)
        is taken out first: the tokenizer would read it as the token itself and end the user turn inside the hint.
        A hint changed either way passes the leak guard again (a cut number can become the answer)."""
        limit = self.args.hint_max_tokens
        if res.text is None:
            return res
        text = _without_special_tokens(self.processing_class, res.text)
        if text != res.text:
            self._counts["hints_special_removed"] += 1
            if not text or leaks(text, req.answer):
                return replace(res, text=None, leaked=res.leaked or bool(text))
            res = replace(res, text=text)
        ids = self.processing_class(res.text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return res
        self._counts["hints_cut"] += 1
        text = self.processing_class.decode(ids[:limit], skip_special_tokens=True).strip()
        if not text or leaks(text, req.answer):
            return replace(res, text=None, leaked=res.leaked or bool(text))
        return replace(res, text=text)

    def _prepare_hints(self) -> None:
        """Before the first update: sources that need the initial policy (fixed hints) write their hints now (their
        time and generate calls count as the first step's hint writing)."""
        self._hints_prepared = True
        if self.scheduler.uses_hints:
            rows = [dict(r) for r in self.train_dataset]
            for r in rows:
                r.setdefault("problem", _problem_of(r))
            t0 = time.perf_counter()
            self.hint_source.prepare(rows, self._hint_context())
            spent = time.perf_counter() - t0
            self._metrics["train"]["sage/hint_prepare_seconds"].append(spent)
            self._hint_seconds += spent  # hint writing, in the first step's hint time (not its rollout time)

    def _draw_prompt(self, taken: set[str]) -> dict | None:
        """A fresh prompt from the train set that is not in `taken` (methods that resample prompts), or None. Each
        process draws from its own share of one permutation (every world-th place), so two processes never swap
        in the same prompt in one step."""
        if self._pool is None:
            # a permutation of its own: TRL's sampler draws torch.randperm from a generator seeded with args.seed, so
            # the same seed made the pool the sampler's epoch order, and every prompt swapped in was one of the next
            # steps' batch (a prompt found collapsed was rolled again a step later)
            gen = torch.Generator().manual_seed(self.args.seed + POOL_SEED_OFFSET)
            rank, world = self.accelerator.process_index, self.accelerator.num_processes
            self._pool = torch.randperm(len(self.train_dataset), generator=gen).tolist()[rank::world]
        n = len(self._pool)
        for _ in range(n):
            i = self._pool[self._pool_pos % n]
            self._pool_pos += 1
            row = dict(self.train_dataset[i])
            if row["prompt_id"] not in taken:
                return row
        return None

    def _record(self, groups, tries, hint_log, rows) -> None:
        """Tracker rows for this step and the step's sage/* metrics, computed on all processes' groups. A group whose
        prompt was swapped for fresh ones (dapo-filter) gives a row per prompt rolled: the trained one with its own
        rollouts, and each swapped-out one (`trained` False) with its own, so "never solved" counts them."""
        method, recs = self.scheduler.name, []
        for pid, idx in groups:
            ts, sel, h = tries[pid], self._selections[pid], hint_log[pid]
            final, trained_id = ts[sel.picks[0][0]], rows[idx[0]]["prompt_id"]
            by_prompt: dict[str, list[Try]] = {}  # the prompts this group rolled, in order, each with its tries
            for t in ts:
                by_prompt.setdefault(t.rows[0]["prompt_id"], []).append(t)
            for prompt_id, own in by_prompt.items():
                trained = prompt_id == trained_id
                if trained:
                    final_rewards = [ts[ti].rewards[ri] for ti, ri in sel.picks]
                    comps = [ts[ti].completions[ri] for ti, ri in sel.picks]
                    last, weight, log_ = final, sel.weight, h
                else:
                    last, weight, log_ = own[-1], 0.0, _no_hint_log()
                    final_rewards, comps = last.rewards, last.completions
                first = own[0]
                base_state = gate.group_state(first.rewards) if first.level == 0 else "na"
                first_state = gate.group_state(first.rewards)
                acc = {lvl: None for lvl in LEVELS}
                for t in own:
                    if t.level > 0 and t.rewards:
                        acc[t.level] = gate.pass_rate(t.rewards)
                row = own[0].rows[0]
                difficulty = row.get("difficulty")
                recs.append(dict(
                    prompt_id=prompt_id, origin_id=pid, trained=trained,
                    problem=row.get("problem") or _problem_of(row), answer=str(row.get("answer")),
                    difficulty=-1 if difficulty is None else int(difficulty),
                    base_pass_rate=gate.pass_rate(first.rewards) if first.level == 0 else float("nan"),
                    base_state=base_state, level=last.level,
                    max_level_tried=max(t.level for t in own), pass_rate=gate.pass_rate(final_rewards),
                    rescued=trained and first_state != "mixed" and not gate.collapsed(final_rewards),
                    hint=last.hint, hint_l1=log_["hints_tried"].get(1), hint_l2=log_["hints_tried"].get(2),
                    hint_l3=log_["hints_tried"].get(3), acc_l1=acc[1], acc_l2=acc[2], acc_l3=acc[3],
                    leak_l1=1 in log_["leaked"], leak_l2=2 in log_["leaked"], leak_l3=3 in log_["leaked"],
                    hint_failed=log_["failed"],
                    rollouts=sum(len(t.rewards) for t in own) + (self._unasked[pid] if trained else 0),
                    completions=[completion_text(c) for c in comps], rewards=final_rewards,
                    pilot_rewards=list(first.rewards), energy=gate.advantage_energy(final_rewards) if trained else 0.0,
                    weight=weight, method=method,
                    # the batch slot's first rollout, whichever prompt the slot trained (for the step's metrics)
                    slot_level=ts[0].level, slot_rewards=list(ts[0].rewards),
                ))
        recs = gather_object(recs)
        step = self.state.global_step + 1
        self.tracker.record(step, recs)
        # the step's metrics are per batch slot (its first rollout, the group it trained): one trained row each
        every, recs = recs, [r for r in recs if r["trained"]]
        m, n = self._metrics["train"], len(recs)
        states = [gate.group_state(r["slot_rewards"]) for r in recs]
        rescued = [s != "mixed" and not gate.collapsed(r["rewards"]) for s, r in zip(states, recs, strict=True)]
        # the gate before hints: the slots whose first rollout had no hint (SAGE-LIGHT rolls a prompt at its tracked
        # level from the start: its gate before hints is not seen; NaN when no slot was rolled without one)
        bare = [s for s, r in zip(states, recs, strict=True) if r["slot_level"] == 0]
        nan = float("nan")
        m["sage/frac_collapsed"].append(sum(s != "mixed" for s in bare) / len(bare) if bare else nan)
        m["sage/frac_all_zero"].append(bare.count("all0") / len(bare) if bare else nan)
        m["sage/frac_all_one"].append(bare.count("all1") / len(bare) if bare else nan)
        m["sage/frac_rescued"].append(sum(rescued) / n)
        m["sage/rescued_groups"].append(float(sum(rescued)))
        # groups trained with an open gate (mixed rewards: a non-zero advantage), whatever the level
        m["sage/open_groups"].append(float(sum(not gate.collapsed(r["rewards"]) for r in recs)))
        m["sage/frac_open"].append(m["sage/open_groups"][-1] / n)
        hinted = [x for r, x in zip(recs, rescued, strict=True) if r["max_level_tried"] > 0 and r["slot_level"] == 0]
        m["sage/rescue_rate"].append(sum(hinted) / len(hinted) if hinted else float("nan"))
        for lvl in (0, *LEVELS):
            m[f"sage/level_{lvl}_frac"].append(sum(r["level"] == lvl for r in recs) / n)
        for lvl in LEVELS:
            accs = [r[f"acc_l{lvl}"] for r in recs if r[f"acc_l{lvl}"] is not None]
            m[f"sage/level_{lvl}_acc"].append(sum(accs) / len(accs) if accs else float("nan"))
        m["sage/hint_failed"].append(float(sum(r["hint_failed"] for r in recs)))
        m["sage/hint_leaks"].append(float(sum(r[f"leak_l{lvl}"] for r in recs for lvl in LEVELS)))
        m["sage/never_solved"].append(self.tracker.never_solved())
        m["sage/never_solved_no_hint"].append(self.tracker.never_solved_no_hint())
        m["sage/adv_energy"].append(sum(r["energy"] for r in recs) / n)
        m["sage/rollouts"].append(float(sum(r["rollouts"] for r in every)))
        base = [gate.pass_rate(r["slot_rewards"]) for r in recs if r["slot_level"] == 0]
        m["sage/base_pass_rate"].append(sum(base) / len(base) if base else float("nan"))

    # ------------------------------------------------------------------------------------------ resume
    def _save_checkpoint(self, model, trial):
        """HF's checkpoint and the JSON files beside it: each process's place in its fresh-prompt pool (methods that
        swap a collapsed group for a new prompt), so that a resumed run draws the prompts the straight run draws,
        each process's scheduler generator (schedulers with a `rng_state()`: a pooled method's subset picks), and
        the scheduler's and the tracker's state (STATE_FILE: what a resume would otherwise replay from every tracker
        file, linear in the run's length; every process observes every group, so one copy serves any count of
        processes), and those of callbacks with a `checkpoint_files()` (sage_core.train.TrainTime: the seconds
        trained, written last: see train.last_checkpoint). Every process calls it; the main process writes."""
        super()._save_checkpoint(model, trial)
        places = gather_object([self._pool_pos])
        files = {POOL_FILE: places} if any(places) else {}
        if hasattr(self.scheduler, "rng_state"):
            files[RNG_FILE] = gather_object([self.scheduler.rng_state()])
        if self.accelerator.is_main_process and _state_holds_observe(self.scheduler):
            files[STATE_FILE] = {"step": self.state.global_step, "method": self.scheduler.name,
                                 "scheduler": self.scheduler.state(), "tracker": self.tracker.state()}
        for cb in self.callback_handler.callbacks:
            files.update(cb.checkpoint_files() if hasattr(cb, "checkpoint_files") else {})
        if self.accelerator.is_main_process:
            ckpt = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            for name, obj in files.items():  # each one whole or not there: a kill mid-write leaves no half file
                write_text_atomic(os.path.join(ckpt, name), json.dumps(obj))

    def restore_state(self, up_to_step: int, checkpoint: str | os.PathLike | None = None) -> int:
        """Take this process's place in the fresh-prompt pool and its scheduler generator from `checkpoint`, and the
        scheduler's and tracker's state at step up_to_step: from the checkpoint's STATE_FILE where it has one of
        that step and method, else (an older checkpoint's, or none) by replaying the tracker files of steps <=
        up_to_step into the tracker and the scheduler, which gives the same state. Returns the count of replayed
        records (0 when the state was read)."""
        place = self._saved_by_process(checkpoint, POOL_FILE, "the fresh prompts drawn")
        if place is not None:
            self._pool_pos = int(place)
        rng = self._saved_by_process(checkpoint, RNG_FILE, "the pooled subsets picked")
        if rng is not None and hasattr(self.scheduler, "load_rng_state"):
            self.scheduler.load_rng_state(rng)
        if (saved := self._saved_state(checkpoint, up_to_step)) is not None:
            self.scheduler.load_state(saved["scheduler"])
            self.tracker.load_state(saved["tracker"])
            return 0
        count = 0
        for rec in self.tracker.reload(up_to_step):
            if rec.get("trained") is not None and not rec["trained"]:  # swapped out (dapo-filter): not observed live
                continue
            self.scheduler.observe(rec["prompt_id"], int(rec["level"]), [float(x) for x in rec["rewards"]],
                                   [float(x) for x in rec["pilot_rewards"]])
            count += 1
        return count

    def _saved_state(self, checkpoint: str | os.PathLike | None, step: int) -> dict | None:
        """The scheduler's and tracker's state in `checkpoint` (STATE_FILE); None without one, or where it is not
        this step's and method's or cannot be read (the caller replays the tracker files then)."""
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint is not None else None
        if path is None or not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                saved = json.load(f)
            found = (saved["step"], saved["method"])
            if found == (step, self.scheduler.name):
                return saved
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("%s cannot be read (%s: %s): the tracker files are replayed instead", path,
                        type(e).__name__, e)
            return None
        log.warning("%s holds the state of %s at step %s, not of %s at step %d: the tracker files are replayed "
                    "instead", path, found[1], found[0], self.scheduler.name, step)
        return None

    def _saved_by_process(self, checkpoint: str | os.PathLike | None, name: str, what: str):
        """This process's entry of the per-process file `name` in `checkpoint`; None without the file or an entry."""
        path = os.path.join(checkpoint, name) if checkpoint is not None else None
        if path is None or not os.path.exists(path):
            return None
        saved = read_per_process_file(path)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        if len(saved) != world:  # each process has its own: the draws cannot follow the straight run
            log.warning("%s: saved by %d processes, resumed by %d: %s after the resume differ from the straight "
                        "run's", path, len(saved), world, what)
        return saved[rank] if rank < len(saved) else None


# ---------------------------------------------------------------------------------------------- helpers
def read_per_process_file(path: str | os.PathLike) -> list:
    """The entries (one per process) of a checkpoint's side file (POOL_FILE, RNG_FILE). One that does not read as a
    list (cut short by a kill, damaged) is a DataError naming it and its checkpoint: there is no other record of it
    to fall back on. train.check_checkpoint reads them before anything loads; restore_state reads them again."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if not isinstance(saved, list):
            raise ValueError("not a list of one entry per process")
    except (OSError, ValueError) as e:
        from .data import DataError

        checkpoint = os.path.basename(os.path.dirname(os.path.abspath(path)))
        raise DataError(f"{path} cannot be read ({e}); remove {checkpoint} to resume from the checkpoint before it, "
                        "or start over (--no-resume)") from e
    return saved


def scheduler_metrics(scheduler: Scheduler, gather=gather_object) -> dict[str, float]:
    """The step's scheduler metrics over every process's groups (every process calls it together): counters summed
    over processes, then the ratios formed (curation methods' metric_counts); a scheduler with only `metrics()`
    has each metric averaged over the processes that have it."""
    if hasattr(scheduler, "metric_counts"):
        counts = gather([scheduler.metric_counts()])
        return scheduler.metrics({k: sum(c[k] for c in counts) for k in counts[0]})
    stats = gather([scheduler.metrics() if hasattr(scheduler, "metrics") else {}])
    out = {}
    for k in stats[0]:
        vals = [d[k] for d in stats if k in d and d[k] == d[k]]
        out[k] = sum(vals) / len(vals) if vals else float("nan")
    return out


def _state_holds_observe(scheduler: Scheduler) -> bool:
    """Whether `state()` holds all that `observe` changes, so that a checkpoint may keep it in place of a replay:
    true of this project's schedulers (SAGE-LIGHT's levels, ada-est's pilot history; the others observe nothing).
    A class that overrides observe below the class whose state and load_state it inherits (a caller's own
    scheduler) is replayed from the tracker instead. A weighted scheduler is judged by the one it wraps."""
    while isinstance(scheduler, Weighted):
        scheduler = scheduler.inner
    mro = type(scheduler).__mro__

    def owner(name: str) -> int:  # how far up the class tree `name` is defined
        return next(i for i, c in enumerate(mro) if name in vars(c))

    return owner("state") <= owner("observe") and owner("load_state") <= owner("observe")


class EpochSampler(RepeatSampler):
    """TRL's RepeatSampler draws one permutation per epoch from a generator seeded once, so a resumed run (a fresh
    sampler) would start its first epoch with epoch 0's order. HF Trainer calls set_epoch(e) before each epoch: when
    e is not the next draw, the generator is re-seeded and the earlier epochs' permutations are drawn and dropped. A
    run that is not resumed draws exactly what TRL's sampler draws."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._drawn = 0  # permutations drawn so far

    def set_epoch(self, epoch: int) -> None:
        if not self.shuffle or self.seed is None or epoch == self._drawn:
            return
        self.generator.manual_seed(self.seed)
        for _ in range(epoch):
            torch.randperm(self.num_samples, generator=self.generator)
        self._drawn = epoch

    def __iter__(self):
        self._drawn += 1
        yield from super().__iter__()

    @contextmanager
    def kept(self):
        """Draws made in the block are taken back after it: the generator and the count of permutations drawn are
        as before (a look at the next epoch's order, which that epoch then draws again)."""
        gen = getattr(self, "generator", None)  # (no generator: not shuffled)
        state, drawn = gen.get_state() if gen is not None else None, self._drawn
        try:
            yield
        finally:
            if gen is not None:
                gen.set_state(state)
            self._drawn = drawn


def _no_hint_log() -> dict:
    """A group's record of the hints it tried this step (by level), the levels whose hint leaked, and whether a hint
    failed; empty."""
    return {"hints_tried": {}, "leaked": set(), "failed": False}


def _groups_by_prompt_id(rows: list[dict], G: int) -> list[tuple[str, list[int]]]:
    """Groups keyed by prompt id. TRL's sampler lays each prompt's G rows out contiguously; check it rather than
    trust positions, and fail loudly if a group is split or mixed."""
    if "prompt_id" not in rows[0]:
        raise ValueError("SAGE needs a unique `prompt_id` column in the dataset (groups are keyed by it)")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        pid = r["prompt_id"]
        if not isinstance(pid, str):
            # the scheduler, the hint sources and the tracker key a prompt by the row's own prompt_id: a str key here
            # and an int there would never meet (SAGE-LIGHT's levels were observed under 3, asked for under "3")
            raise ValueError(f"prompt_id must be a str, got {type(pid).__name__} {pid!r}: give the dataset a str "
                             "prompt_id column (sage_core.data writes one)")
        groups[pid].append(i)
    for pid, idx in groups.items():
        if len(idx) != G or idx != list(range(idx[0], idx[0] + G)):
            raise RuntimeError(f"prompt {pid!r} has rows {idx} on this process; expected {G} contiguous rows")
    return list(groups.items())


def _bucket_overhead(trainer) -> int:
    """Default per-forward overhead of the loss's length buckets, in token slots (see SageConfig)."""
    return 2048 if trainer.accelerator.device.type == "cuda" else 256


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings", "position_embedding", "pos_emb")


def _absolute_positions(model: nn.Module) -> bool:
    """Whether the model adds a learned embedding of each token's position (GPT-2's wpe, GPT-Neo's, BioGPT's, OPT's):
    such a forward numbers a row's columns 0.. with its left padding (TRL passes no position_ids), so trimming a
    bucket's shared left padding would move every row to other positions and change its log-probs. Rotary and ALiBi
    positions only enter relative to each other, and trimming changes nothing there."""
    return any(isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
               for name, m in model.named_modules())


def _multimodal(model: nn.Module) -> bool:
    """A vision-language model: its text forward may take positions from state a generate call left (Qwen2.5-VL's
    rope_deltas), so its rows never share a prompt's cache."""
    config = getattr(model, "config", None)
    return config is not None and (hasattr(config, "vision_config") or config.get_text_config() is not config)


# GenerationConfig fields whose non-neutral values change greedy decoding's choice at some step (HF generate fills
# each one TRL leaves unset from the model's own generation_config): field -> its neutral values
_ARGMAX_FIELDS = {"do_sample": (False, None), "num_beams": (1, None), "repetition_penalty": (1.0, None),
                  "encoder_repetition_penalty": (1.0, None), "no_repeat_ngram_size": (0, None),
                  "min_length": (0, None), "min_new_tokens": (0, None), "bad_words_ids": (None,),
                  "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "sequence_bias": (None,),
                  "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
                  "exponential_decay_length_penalty": (None,), "diversity_penalty": (0.0, None),
                  "guidance_scale": (None, 1.0), "watermarking_config": (None,), "low_memory": (None, False)}


def _argmax_changed(config, model_config, sampled: bool = False) -> bool:
    """Whether greedy decoding under `config` (TRL's), with the fields it leaves unset taken from `model_config`
    (the model's), is anything but the argmax of the logits at each step. `sampled`: whether the logits processors
    of a sampling call under it (those that run before a custom processor: the sampling warpers come after) change
    the argmax."""
    for name, neutral in _ARGMAX_FIELDS.items():
        if sampled and name == "do_sample":
            continue
        value = getattr(config, name, None)
        if value is None and model_config is not None:
            value = getattr(model_config, name, None)
        if not any(value is n or (n is not None and value == n) for n in neutral):
            return True
    return False


_DROPOUT_NAMES = ("dropout", "pdrop", "jitter_noise")  # e.g. attention_dropout, resid_pdrop, router_jitter_noise


def _dropout_active(model: nn.Module) -> bool:
    """Whether a forward of `model` now draws at random (a Dropout module, or a config rate such as attention_dropout,
    hidden_dropout, resid_pdrop or router_jitter_noise, in training mode): greedy decoding is then no function of the
    prompt, and a draft cannot be checked."""
    if not model.training:
        return False
    def drops(attrs: dict) -> bool:
        return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                   and any(n in k for n in _DROPOUT_NAMES) for k, v in attrs.items())

    configs = {}
    for m in model.modules():
        if (isinstance(m, nn.Dropout) and m.p > 0) or drops(vars(m)):
            return True
        if hasattr(config := getattr(m, "config", None), "to_dict"):
            configs[id(config)] = config
    return any(drops(c.to_dict()) for c in configs.values())


def _params_sharded(trainer) -> bool:
    """ZeRO-3 or FSDP: every forward gathers parameters collectively, so all ranks must run the same forwards."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(trainer.is_fsdp_enabled or (trainer.is_deepspeed_enabled and getattr(plugin, "zero_stage", 0) == 3))


def _served_context(base_url: str, timeout: float = 10.0) -> int | None:
    """The max_model_len a vLLM server reports for its model (`GET /v1/models`), or None if it does not say."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=timeout) as r:
            models = json.load(r).get("data") or [{}]
    except (OSError, ValueError):
        return None
    limit = models[0].get("max_model_len")
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def _seen(tries: list[Try]) -> list[tuple[int, list[float]]]:
    """What a scheduler sees of a group's tries: (level, rewards) in order."""
    return [(t.level, t.rewards) for t in tries]


def _log_hint(log: dict, level: int, res: HintResult) -> None:
    if res.text is not None:
        log["hints_tried"][level] = res.text
    if res.leaked:
        log["leaked"].add(level)
    if res.failed:
        log["failed"] = True


def _without_special_tokens(tokenizer, text: str) -> str:
    """`text` with the text of each special token of `tokenizer` (eos, pad, chat markers as <|im_start|>) replaced by
    a space, each line's spaces then closed up; `text` itself where it holds none. A tokenizer reads such text as the
    token."""
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    special |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if t.special}
    found = sorted((s for s in special if s and s in text), key=len, reverse=True)
    if not found:
        return text
    for s in found:
        text = text.replace(s, " ")
    return "\n".join(" ".join(line.split()) for line in text.split("\n")).strip()


@contextmanager
def _generate_replaced(model: nn.Module, generate):
    """`model.generate` is `generate` (an instance attribute) for the block, then the model's own again (or the
    instance attribute it had: wrappers nest)."""
    own = model.__dict__.get("generate")
    model.generate = generate
    try:
        yield
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


def _hint_request(row: dict, level: int) -> HintRequest:
    return HintRequest(row["prompt_id"], row.get("problem") or _problem_of(row), row.get("solution") or "",
                       str(row["answer"]), level)


def _problem_of(row: dict) -> str:
    p = row["prompt"]
    return p if isinstance(p, str) else [m for m in p if m["role"] == "user"][-1]["content"]
