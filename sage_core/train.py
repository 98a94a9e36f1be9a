"""train(spec, output_dir): one SAGE/GRPO run from a RunSpec, end to end (model, data, trainer, checkpoints).

MLflow logging is not done here: callers pass `sage_core.tracking`'s callback (the flows and the CLI do).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from transformers import TrainerCallback, TrainerState

from .atomic import write_text_atomic
from .lora import ADAPTER_DIR, check_targets, merge_adapter, peft_config, record_base
from .spec import RunSpec, check_run_folder, layout_error, run_folder_lock, spec_changes

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: Path
    checkpoint_dir: Path  # final model + tokenizer (load with sage_core.models.load_policy)
    tracker_dir: Path
    global_step: int
    wall_seconds: float
    summary: dict[str, float]
    log_history: list[dict] = field(default_factory=list)
    eval: pd.DataFrame | None = None


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class LayoutError(ValueError):
    """A spec whose batch does not split over this run's processes (known only once they are started)."""


def build_config(spec: RunSpec, output_dir: str | Path):
    """SageConfig for a spec: batch shapes so that one generation batch is prompts_per_step x G rows."""
    import torch

    from .data import eval_set_name
    from .trainer import CHECKPOINTING_ARG, SageConfig

    world = world_size()
    if (why := layout_error(spec, world)) is not None:
        raise LayoutError(why)
    G = spec.num_generations
    local = spec.prompts_per_step * G // world  # rows each process rolls out per step
    micro = spec.micro_batch_size or local
    steps_per_generation = local // micro
    cuda = torch.cuda.is_available()
    bf16 = cuda if spec.bf16 is None else spec.bf16
    vllm_len = None
    if spec.use_vllm and spec.max_prompt_length:  # room for the hint and its header (and the hint request)
        vllm_len = spec.max_prompt_length + spec.hint_max_tokens + 256 + spec.max_completion_length
    return SageConfig(
        output_dir=str(output_dir),
        max_steps=spec.max_steps * spec.updates_per_generation,
        learning_rate=spec.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        per_device_train_batch_size=micro,
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=steps_per_generation // spec.updates_per_generation,
        num_generations=G,
        max_completion_length=spec.max_completion_length,
        temperature=spec.temperature,
        epsilon=spec.epsilon,
        epsilon_high=spec.epsilon_high,
        beta=spec.beta,
        loss_type=spec.loss_type,
        seed=spec.seed,
        data_seed=spec.seed,
        save_strategy="steps",
        save_steps=spec.save_steps * spec.updates_per_generation,
        save_total_limit=spec.keep_checkpoints,
        logging_steps=1,
        report_to="none",
        use_cpu=not cuda,
        bf16=bf16,
        **{CHECKPOINTING_ARG: spec.gradient_checkpointing},
        use_vllm=spec.use_vllm,
        vllm_mode=spec.vllm_mode,
        vllm_gpu_memory_utilization=spec.vllm_gpu_memory_utilization,
        vllm_server_base_url=spec.vllm_server_base_url,
        vllm_max_model_length=vllm_len,
        disable_tqdm=True,
        dataloader_num_workers=0,
        sage_method=spec.method,
        hint_max_tokens=spec.hint_max_tokens,
        hint_retries=spec.hint_retries,
        hint_temperature=spec.hint_temperature,
        light_min=spec.light_min,
        light_max=spec.light_max,
        sage_max_rounds=max(spec.max_rounds, 3),
        sage_lookahead=spec.lookahead,
        sage_length_buckets=spec.length_buckets,
        sage_skip_zero_advantage=spec.skip_zero_advantage,
        sage_shared_prefix=spec.shared_prefix,
        sage_shared_prefill=spec.shared_prefill,
        sage_hint_drafts=spec.hint_drafts,
        sage_hint_prefetch=spec.hint_prefetch,
        sage_measure_activations=spec.measure_activations,
        sage_eval_every=spec.eval_every * spec.updates_per_generation if spec.eval_every else None,
        sage_eval_name=eval_set_name(spec),
        sage_eval_k=spec.eval_k,
        sage_eval_temperature=spec.eval_temperature,
        sage_eval_top_p=spec.eval_top_p,
    )


class RolloutBudget(TrainerCallback):
    """Stops training once `budget` completions were rolled out (re-rolls and resampled prompts included), saving a
    checkpoint of the step it stops at (the model trained, and where a rerun finds the run done)."""

    def __init__(self, budget: int):
        self.budget, self.spent = budget, 0.0

    @staticmethod
    def spent_in(history: list[dict]) -> float:
        return sum((h.get("sage/rollouts", 0.0) or 0.0) for h in history)

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run has already spent what its checkpoint's log history holds."""
        self.spent = self.spent_in(state.log_history)

    def stops_at(self, args, state, rollouts: float) -> bool:
        """Whether the step now ending, logging `rollouts`, ends training (the trainer asks before its log, to
        evaluate a last step: eval_every)."""
        # a rollout batch is trained by updates_per_generation optimizer steps, and its rollouts are logged with
        # the first: stop after its last, so the batch is trained whole and the checkpoint is where a resumed run
        # generates its next batch (one saved mid-batch made the resumed run roll that batch's prompts again)
        per_batch = max(1, args.steps_per_generation // args.gradient_accumulation_steps)
        return self.spent + rollouts >= self.budget and state.global_step % per_batch == 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        rollouts = (logs or {}).get("sage/rollouts", 0.0) or 0.0
        if self.stops_at(args, state, rollouts):
            control.should_training_stop = True
            control.should_save = True
        self.spent += rollouts


class SaveSteps(TrainerCallback):
    """A resumed run saves every `save_steps` of its spec: HF's Trainer keeps the interval its checkpoint's
    trainer_state.json recorded (a resume with save_steps 2 -> 1 still saved every 2 steps)."""

    def on_train_begin(self, args, state, control, **kwargs):
        state.save_steps = args.save_steps


FINAL_STEP_FILE = "sage_final_step.json"  # in final/: the optimizer step its model was saved at


def final_step(final: Path) -> int | None:
    """The step a run's final/ model was saved at (None: no final/, or one saved before this record)."""
    try:
        return int(json.loads((final / FINAL_STEP_FILE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


TRAIN_SECONDS_FILE = "sage_train_seconds.json"  # in each checkpoint: the loop's and the wall seconds up to it


class TrainTime(TrainerCallback):
    """The training loop's time and the wall-clock time (model loading and saving included) over every session of a
    run: each checkpoint records the seconds up to it (earlier sessions' and this one's), and a resumed run starts
    from its checkpoint's. A session that ends at a checkpoint records its whole wall time there (record_wall), so
    that a finished run entered again (a re-run after its evaluation crashed, a new worker) reports its sessions'
    wall time, not the seconds it took to load. The time a killed session spent after its last checkpoint is not
    counted: those steps are trained (and timed) again."""

    def __init__(self, before: float = 0.0, wall_before: float = 0.0, started: float | None = None):
        self.before, self.t0 = before, time.perf_counter()
        self.wall_before, self.started = wall_before, self.t0 if started is None else started
        self.not_training = lambda: 0.0  # seconds of this session's loop spent on something else (the eval)

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def checkpoint_files(self) -> dict[str, dict]:
        """What the trainer writes beside each checkpoint it saves (SageGRPOTrainer._save_checkpoint)."""
        return {TRAIN_SECONDS_FILE: {"train_seconds": self.seconds(), "wall_seconds": self.wall_seconds()}}

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.t0 - self.not_training()

    def wall_seconds(self) -> float:
        """The run's wall seconds: its earlier sessions' (up to the checkpoint this one resumed from) and this one's
        since it `started` (NaN where the checkpoint has no record of them)."""
        return self.wall_before + time.perf_counter() - self.started

    @staticmethod
    def record_wall(ckpt: Path, wall: float) -> None:
        """Record `wall` (the run's wall seconds at the end of a session) in the checkpoint it ended at, the one the
        next session resumes from; its training seconds are kept. Replaced whole: a reader never sees half a file
        (last_checkpoint takes the file for the mark of a whole checkpoint)."""
        path = ckpt / TRAIN_SECONDS_FILE
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return  # not written by this version, or cut short: nothing to add the wall time to
        write_text_atomic(path, json.dumps({**record, "wall_seconds": wall}))

    @staticmethod
    def wall_at(ckpt: Path | None) -> float:
        """Wall seconds of the sessions up to a checkpoint (0 without one; NaN for one written before this record)."""
        return TrainTime.at(ckpt, "wall_seconds")

    @staticmethod
    def at(ckpt: Path | None, key: str = "train_seconds") -> float:
        """Seconds trained (`key`: or wall seconds) up to a checkpoint (0 without one; NaN for a checkpoint written
        before this record)."""
        if ckpt is None:
            return 0.0
        try:
            return float(json.loads((ckpt / TRAIN_SECONDS_FILE).read_text())[key])
        except (OSError, ValueError, KeyError, TypeError):
            return float("nan")


def _trainer_inputs(spec: RunSpec, output_dir: str | Path):
    """What every trainer of a spec is built from: its config, data set, model and tokenizer."""
    import torch

    from .data import DataError, build_dataset
    from .models import BadModelFile, end_of_turn_not_a_stop, load_policy
    from .reward import warm_pool_in_background
    from .vllm_cpu import engines_eager_if_asked, keep_plain_weights

    args = build_config(spec, output_dir)
    if spec.use_vllm:  # without CUDA: vLLM's CPU build, with weights TRL can sync (sage_core.vllm_cpu)
        keep_plain_weights()
        engines_eager_if_asked()
    dataset = build_dataset(spec)
    if len(dataset) < spec.prompts_per_step:  # TRL's sampler would draw no step and "finish" having trained nothing
        raise DataError(f"{spec.data}: {len(dataset)} training prompts, fewer than prompts_per_step="
                        f"{spec.prompts_per_step}; raise num_prompts (or use a larger data set) or lower "
                        "prompts_per_step")
    warm_pool_in_background()
    # float32 master weights, as TRL loads them (transformers 5 would load a bf16 checkpoint in bf16, where AdamW
    # steps of lr 1e-6 round to nothing); bf16 compute comes from args.bf16 (autocast), vLLM reads the config
    model, tokenizer = load_policy(spec.model, spec.gguf_file, dtype=torch.float32)
    if not getattr(tokenizer, "chat_template", None):  # TRL would fail mid-step, deep in _tokenize_prompts
        raise BadModelFile(f"model {spec.model}: its tokenizer has no chat template, and SAGE's prompts are chat "
                           "messages (the hint goes into the last user turn): use an instruct model, or set the "
                           "tokenizer's chat_template and save it with the model")
    check_prompts_render(spec, dataset, tokenizer)
    if (end := end_of_turn_not_a_stop(tokenizer, getattr(model, "generation_config", None))) is not None:
        log.warning("model %s: its chat template ends an assistant turn with %r, which is not one of the tokens a "
                    "completion stops at (generation_config.json's eos_token_id, the tokenizer's eos_token): every "
                    "rollout will run on to max_completion_length (%d tokens) past its answer. Add its id to "
                    "eos_token_id in the model folder's generation_config.json", spec.model, end,
                    spec.max_completion_length)
    check_targets(spec, model)  # a LoRA target the policy lacks: peft's traceback, once the trainer is built
    if spec.max_prompt_length:
        dataset = _drop_long_prompts(spec, dataset, tokenizer, output_dir)
    check_context(spec, dataset, tokenizer, model)
    return args, dataset, model, tokenizer


def check_context(spec: RunSpec, dataset, tokenizer, model) -> None:
    """The longest training prompt, with room for a hint where the method writes hints (hint_max_tokens and the hint
    header) and for max_completion_length new tokens, fits the model's context (its config's
    max_position_embeddings). HF generate does not stop at it: a model with learned positions (GPT-2's) failed
    mid-step with torch's 'index out of range in self', one with rotary positions trained silently on positions it
    was never trained for. A DataError naming the model, its context and the lengths, before training."""
    from .data import DataError, prompt_lengths
    from .models import config_context
    from .prompts import HINT_HEADER

    context = config_context(model.config)
    if not context or not len(dataset):
        return
    hint = len(tokenizer.encode(f"\n{HINT_HEADER}\n", add_special_tokens=False)) + spec.hint_max_tokens \
        if spec.uses_hints else 0
    if spec.max_prompt_length and spec.max_prompt_length + hint + spec.max_completion_length <= context:
        return  # the prompts are at most max_prompt_length tokens (_drop_long_prompts): no need to count them again
    lengths = prompt_lengths(dataset["prompt"], tokenizer)
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    need = lengths[longest] + hint + spec.max_completion_length
    if need > context:
        with_hint = f" + a hint of up to {hint} tokens (hint_max_tokens={spec.hint_max_tokens} and its header)" \
            if hint else ""
        raise DataError(f"model {spec.model}: its context is {context} tokens (max_position_embeddings), fewer than "
                        f"a training prompt needs: {dataset[longest]['prompt_id']!r} has {lengths[longest]} tokens"
                        f"{with_hint} + max_completion_length={spec.max_completion_length} = {need}; lower "
                        "max_completion_length" + (" or hint_max_tokens" if hint else "") + ", set "
                        "max_prompt_length to leave longer prompts out, or use a model with a longer context")


def check_prompts_render(spec: RunSpec, dataset, tokenizer) -> None:
    """The policy's chat template renders each kind of prompt the run sends it (models.check_chat_template): a
    training prompt (the paper's system turn for a model other than 'tiny'), a hinted one and, where the policy
    writes its hints (online, fixed), a hint request (a user turn alone). A template that refuses one failed with
    jinja's traceback mid-step (a template asking for a system turn: at the first hint request)."""
    from .hints import HintRequest, request_prompt
    from .models import check_chat_template
    from .prompts import hinted_problem

    row = dataset[0]
    if isinstance(row["prompt"], str):  # a plain-text prompt: TRL sends it without the template
        return
    kinds = {"a training prompt": list(row["prompt"])}
    if spec.uses_hints:
        hinted = [dict(m) for m in row["prompt"]]
        last = max(i for i, m in enumerate(hinted) if m["role"] == "user")
        hinted[last]["content"] = hinted_problem(hinted[last]["content"], "a hint")
        kinds["a hinted training prompt"] = hinted
        if spec.hint_source != "teacher":
            problem = row.get("problem") or hinted[last]["content"]
            kinds["a hint request (the policy writes its own hints)"] = request_prompt(
                HintRequest(str(row["prompt_id"]), problem, row.get("solution") or "", str(row["answer"]), 1))
    check_chat_template(tokenizer, spec.model, kinds)


def _drop_long_prompts(spec: RunSpec, dataset, tokenizer, output_dir: str | Path):
    """Rows whose prompt is longer than spec.max_prompt_length tokens are left out of training; their ids and
    lengths go to `<output_dir>/dropped_prompts.json` (the data file itself is only read)."""
    from .data import DataError, drop_long_prompts
    from .tracking import DROPPED_PROMPTS

    kept, dropped = drop_long_prompts(dataset, tokenizer, spec.max_prompt_length)
    if not dropped:
        return dataset
    path = Path(output_dir) / DROPPED_PROMPTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"max_prompt_length": spec.max_prompt_length,
                                "dropped": [{"prompt_id": pid, "tokens": n} for pid, n in dropped]}, indent=1))
    log.warning("%s: %d of %d prompts are longer than max_prompt_length=%d tokens and are left out of training "
                "(e.g. %s); the list is in %s", spec.data, len(dropped), len(dataset), spec.max_prompt_length,
                ", ".join(f"{pid} ({n} tokens)" for pid, n in dropped[:3]), path)
    if len(kept) < spec.prompts_per_step:
        raise DataError(f"{spec.data}: {len(kept)} of {len(dataset)} prompts fit max_prompt_length="
                        f"{spec.max_prompt_length} tokens, fewer than prompts_per_step={spec.prompts_per_step} "
                        f"(longest: {max(n for _, n in dropped)} tokens; see {path}); raise max_prompt_length")
    return kept


def build_trl_grpo_trainer(spec: RunSpec, output_dir: str | Path, callbacks=()):
    """TRL's own GRPOTrainer on the spec's config, data, model and reward: the baseline a user would otherwise run
    (no scheduler, no tracker, no sage/* metrics but sage/activation_mb when the spec measures activations, every
    row trained on one padded tensor)."""
    from trl import GRPOTrainer

    from .memory import measured
    from .reward import boxed_reward

    args, dataset, model, tokenizer = _trainer_inputs(spec, output_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=[boxed_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=list(callbacks), peft_config=peft_config(spec))
    record_base(trainer.model, spec)
    if spec.measure_activations:  # the same count as SageGRPOTrainer's, around TRL's own loss
        trainer._compute_loss = measured(trainer._compute_loss, trainer._metrics["train"])
    return trainer


def build_trainer(spec: RunSpec, output_dir: str | Path, callbacks=(), check_teacher: bool = True):
    """SageGRPOTrainer for `spec`. check_teacher False: a teacher endpoint is not asked whether it is up (a run that is
    done and trains nothing: the server may be gone since)."""
    from .hints import OnlineHints, make_hint_source
    from .periodic_eval import periodic_eval_rows
    from .reward import boxed_reward
    from .schedulers import make_scheduler
    from .trainer import SageGRPOTrainer

    # before the policy loads, so a bad teacher (no such file or model) fails at once; a method that uses no hints
    # builds none (an OnlineHints never asked), whatever hint_source and teacher say
    hint_source = make_hint_source(spec.hint_source, output_dir, spec.teacher, spec.teacher_model,
                                   spec.hint_max_tokens, check=check_teacher) if spec.uses_hints else OnlineHints()
    args, dataset, model, tokenizer = _trainer_inputs(spec, output_dir)
    scheduler = make_scheduler(spec.method, light_min=spec.light_min, light_max=spec.light_max,
                               max_rounds=spec.max_rounds, weighting=spec.weighting,
                               num_generations=spec.num_generations, seed=spec.seed)  # a study's seeds pick apart
    callbacks = [*callbacks, SaveSteps(), *([RolloutBudget(spec.rollout_budget)] if spec.rollout_budget else [])]
    trainer = SageGRPOTrainer(model=model, reward_funcs=[boxed_reward], args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=list(callbacks), scheduler=scheduler,
                              hint_source=hint_source, peft_config=peft_config(spec),
                              eval_rows=periodic_eval_rows(spec, tokenizer))
    record_base(trainer.model, spec)
    return trainer


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest whole checkpoint: HF's trainer_state.json is there and, where the run's checkpoints carry the
    trainer's side files (the training seconds are written last, after the fresh-prompt pool and the scheduler's
    generator), those too; one without them beside ones with them was cut short by a kill while saving. One chosen
    without them (the only one, or all written by an older version) is warned about: it resumes, but what the side
    files hold is not known."""
    ckpts = [p for p in Path(output_dir).glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)]
    ckpts = [p for p in ckpts if (p / "trainer_state.json").exists()]
    if whole := [p for p in ckpts if (p / TRAIN_SECONDS_FILE).exists()]:
        if cut := sorted(p.name for p in set(ckpts) - set(whole)):
            log.warning("%s: %s not whole (saving was cut short): not resumed from", output_dir, ", ".join(cut))
        ckpts = whole
    ckpt = max(ckpts, key=lambda p: int(p.name.split("-")[1]), default=None)
    if ckpt is not None and not (ckpt / TRAIN_SECONDS_FILE).exists():
        log.warning("%s has no %s (saving was cut short after HF's files, or an older version wrote it): resumed "
                    "from, but the training seconds before it are unknown (train_seconds NaN) and, for methods "
                    "that draw fresh prompts or pooled subsets, their place may be lost too (the draws after the "
                    "resume then differ from the straight run's)", ckpt, TRAIN_SECONDS_FILE)
    return ckpt


def remove_earlier_models(output_dir: Path) -> list[str]:
    """Delete what an earlier run in `output_dir` trained (checkpoint-N/, final/, the LoRA adapter/): a run that
    starts over there would otherwise leave them beside its own, and a later resume would continue from the earlier
    run's last checkpoint, past the new run's steps. Returns the names removed."""
    gone = []
    for p in sorted(output_dir.iterdir()):
        if p.is_dir() and (re.fullmatch(r"checkpoint-\d+", p.name) or p.name in ("final", ADAPTER_DIR)):
            shutil.rmtree(p)
            gone.append(p.name)
    return gone


def check_checkpoint(ckpt: Path, save_only_model: bool = False) -> None:
    """A checkpoint a run resumes from must be readable and whole: its trainer state (JSON), its weights
    (safetensors headers, which also hold the file sizes), its optimizer and scheduler states (HF's Trainer loads
    them only where both are there, and otherwise goes on silently with a fresh optimizer: its moments lost) and
    every torch file in it (.pt/.pth: torch.save writes a zip archive, whose directory at the end a file cut short
    lacks; torch.load would fail deep in the resume, naming no file). A bad one is a DataError naming the file,
    before anything runs. A missing RNG state (rng_state*.pth) is a warning: the run resumes, but its sampling is no
    longer the straight run's. Not required: the optimizer and scheduler of a `save_only_model` checkpoint
    (build_config asks for none), nor those of DeepSpeed's layout (global_step*/ holds its own files)."""
    from .data import DataError
    from .models import unreadable_safetensors

    def bad(path: Path, why: str) -> DataError:
        return DataError(f"{path} {why}; remove {ckpt.name} to resume from the checkpoint before it, or start over "
                         "(--no-resume)")

    state = ckpt / "trainer_state.json"
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise bad(state, f"cannot be read ({e})") from e
    if (unreadable := unreadable_safetensors(ckpt)) is not None:
        raise bad(unreadable[0], f"cannot be read ({unreadable[1]})")
    if not save_only_model and not _deepspeed_layout(ckpt):
        if not _has_optimizer(ckpt):
            raise bad(ckpt / "optimizer.pt", "is missing (HF's Trainer would resume with a fresh optimizer)")
        if not (ckpt / "scheduler.pt").is_file():
            raise bad(ckpt / "scheduler.pt", "is missing (HF's Trainer would resume with a fresh optimizer and "
                      "scheduler: it loads them only together)")
    for path in sorted(ckpt.iterdir()):
        if path.suffix in (".pt", ".pth") and path.is_file() and not zipfile.is_zipfile(path):
            raise bad(path, "cannot be read (not a whole torch file: cut short, or not written by torch.save)")
    from .trainer import POOL_FILE, RNG_FILE, read_per_process_file

    for path in (ckpt / POOL_FILE, ckpt / RNG_FILE):  # each process's place in its draws: read as it is, no fallback
        if path.exists():
            read_per_process_file(path)
    world = world_size()
    rng = ["rng_state.pth"] if world == 1 else [f"rng_state_{i}.pth" for i in range(world)]
    if missing := [name for name in rng if not (ckpt / name).is_file()]:
        log.warning("%s: no %s: the run resumes, but its random generators are not restored (the sampling after "
                    "the resume differs from the straight run's)", ckpt, ", ".join(missing))


def _deepspeed_layout(ckpt: Path) -> bool:
    """A DeepSpeed checkpoint: its optimizer (and maybe scheduler) states are in global_step*/ ('latest' names it)."""
    return (ckpt / "latest").is_file() or any(p.is_dir() for p in ckpt.glob("global_step*"))


def _has_optimizer(ckpt: Path) -> bool:
    """Whether HF's Trainer finds an optimizer state in `ckpt`: optimizer.pt, or FSDP's optimizer.bin or sharded
    optimizer_*/ folder (as Trainer._load_optimizer_and_scheduler looks for them)."""
    return ((ckpt / "optimizer.pt").is_file() or (ckpt / "optimizer.bin").is_file()
            or any(p.is_dir() and "optimizer" in p.name for p in ckpt.iterdir()))


def check_tracker_files(output_dir: Path, ckpt: Path, every: int = 1) -> None:
    """A run resuming from `ckpt` (step N) needs the tracker file of every rollout batch up to N (steps 1, 1 +
    every, ...: a batch is trained by `every` = updates_per_generation optimizer steps): they are the run's
    per-prompt record (the dashboard's, never_solved's), and from a checkpoint without the state file the per-prompt
    state (the SAGE-LIGHT levels, the prompts ever solved) is replayed from them. Missing ones (a checkpoint copied
    without tracker/, files deleted) would leave a gap in that record or reset that state silently: a DataError
    listing their steps and the folder. A file cut short is refused too (PromptTracker.check_files), before the
    policy loads, whether the state is then read from the checkpoint or replayed."""
    from .data import DataError
    from .tracker import PromptTracker, step_of

    tracker = PromptTracker(output_dir / "tracker", write=False)  # SageConfig's tracker_dir (build_config sets none)
    tdir, step = tracker.dir, int(ckpt.name.split("-")[1])
    have = {step_of(f.name) for f in tracker.files(step)}
    if missing := [s for s in range(1, step + 1, every) if s not in have]:
        one = len(missing) == 1
        it = "it" if one else "them"
        raise DataError(f"{tdir}: the tracker {'file of step' if one else 'files of steps'} {_spans(missing)} "
                        f"{'is' if one else 'are'} missing (resuming from {ckpt.name}): the run's per-prompt record "
                        f"and state are kept in the tracker files: restore {it}, or start over (--no-resume)")
    tracker.check_files(step)


def _spans(steps: list[int], most: int = 8) -> str:
    """Sorted steps compactly: 1-4, 7, 9-10 (at most `most` spans, then the count)."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans[:most])
    return text + (f", ... ({len(steps)} in all)" if len(spans) > most else "")


def train(spec: RunSpec, output_dir: str | Path, callbacks=(), resume: bool = True) -> TrainResult:
    """Train one run. With resume=True a run whose output_dir holds a checkpoint continues from it (optimizer,
    step, and the scheduler/tracker state kept in the checkpoint or replayed from the tracker files). An output_dir
    holding a run of another spec is refused (RunFolderTaken) before anything is written, as is one another process
    trains in (spec.run_folder_lock, held until this returns). Ended by an exception, each callback with an
    `end_run` is told (a tracking callback that opened its MLflow run itself ends it KILLED or FAILED)."""
    try:
        check_run_folder(spec, output_dir)  # before the lock's file is made there
        with run_folder_lock(output_dir):
            return _train(spec, output_dir, callbacks, resume)
    except BaseException as e:
        for cb in callbacks:
            if hasattr(cb, "end_run"):
                try:
                    cb.end_run(e)
                except Exception as why:  # noqa: BLE001 - the error that ended training is the one to raise
                    log.warning("%s could not end its run (%s: %s)", type(cb).__name__, type(why).__name__, why)
        raise


TRAINING_ROWS = "training_rows.json"  # [prompt_id, digest] of each training row, in order: what a resume checks
ROW_FIELDS = ("prompt", "problem", "solution", "answer")  # what training reads of a row (difficulty is a label)


def row_digests(dataset) -> list[list[str]]:
    """[prompt_id, digest of the fields training reads] of every training row, in the data set's order."""
    fields = [f for f in ROW_FIELDS if f in dataset.column_names]
    return [[row["prompt_id"], hashlib.sha256(json.dumps([row[f] for f in fields], sort_keys=True, default=str,
                                                         ensure_ascii=False).encode()).hexdigest()[:16]]
            for row in dataset]


def rows_changed(old: list, new: list) -> str:
    """What differs between two row_digests lists, in words ("" when they are the same)."""
    if old == new:
        return ""
    before, after = dict(map(tuple, old)), dict(map(tuple, new))

    def some(ids: list[str]) -> str:
        return ", ".join(ids[:3]) + (f", ... ({len(ids)} in all)" if len(ids) > 3 else "")

    parts = [f"{len(ids)} {what} ({some(ids)})" for what, ids in (
        ("changed", [p for p, d in after.items() if before.get(p, d) != d]),
        ("added", [p for p in after if p not in before]),
        ("removed", [p for p in before if p not in after])) if ids]
    return "; ".join(parts) or "the same rows in another order"


def check_training_rows(output_dir: str | Path, dataset, data: str, resuming: bool, main: bool = True) -> str:
    """A run records the rows it starts on (`<output_dir>/training_rows.json`, by prompt id: a digest of its prompt,
    problem, solution and answer, in order); a resume whose rows differ (the data file was edited, or another one
    now has its path) raises a DataError naming the rows, before anything of the run is touched: it would train
    other prompts under the first ones' ids (their tracker history, SAGE-LIGHT levels and fixed hints). A run
    started before this file existed records its rows at its next resume. The main process writes the file. Not
    resuming (no checkpoint), it returns what changed or was added since the rows recorded there ("" for none, or no
    record): a run that failed before its first checkpoint left fixed hints for its own rows."""
    from .data import DataError

    path, rows = Path(output_dir) / TRAINING_ROWS, row_digests(dataset)
    try:
        old = json.loads(path.read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError, TypeError):  # none (an older run's folder) or unreadable: recorded anew
        old = None
    if old is not None and resuming:
        if changed := rows_changed(old, rows):
            raise DataError(f"{output_dir}: the training rows of {data} are not the ones this run started on "
                            f"({changed}); resuming would train other prompts under their ids: train them into "
                            "another output dir, or start this run over (resume off: sage train --no-resume)")
        return ""
    before = dict(map(tuple, old or []))
    changed = rows_changed(old, rows) if old is not None and any(before.get(p) != d for p, d in rows) else ""
    if main:
        write_text_atomic(path, json.dumps({"data": data, "rows": rows}))
    return changed


def is_done(spec: RunSpec, step: int, state: TrainerState) -> bool:
    """Whether a run whose checkpoint is at optimizer step `step` (its trainer state `state`) has nothing left to
    train: max_steps reached (in optimizer steps: updates_per_generation a batch), or its rollout budget spent."""
    return step >= spec.max_steps * spec.updates_per_generation or bool(
        spec.rollout_budget and RolloutBudget.spent_in(state.log_history) >= spec.rollout_budget)


def _train(spec: RunSpec, output_dir: str | Path, callbacks, resume: bool) -> TrainResult:
    from transformers import set_seed

    output_dir = Path(output_dir)
    check_run_folder(spec, output_dir)
    # a folder where a run of another spec failed before its first step (check_run_folder lets it through): what
    # that run left for its own start (fixed hints, written by its initial policy for its problems) is not read
    earlier = spec_changes(spec, output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # every process writes the same spec, each through a file of its own renamed over it: a reader (another
    # process's folder check) never sees a half-written one
    write_text_atomic(output_dir / "spec.json", spec.model_dump_json(indent=2))
    set_seed(spec.seed)
    t0 = time.perf_counter()
    ckpt = last_checkpoint(output_dir) if resume else None
    if ckpt is not None:
        check_checkpoint(ckpt)
        check_tracker_files(output_dir, ckpt, spec.updates_per_generation)
    step = int(ckpt.name.split("-")[1]) if ckpt is not None else 0
    clock = TrainTime(TrainTime.at(ckpt), TrainTime.wall_at(ckpt), started=t0)
    state = TrainerState.load_from_json(str(ckpt / "trainer_state.json")) if ckpt is not None else None
    done = state is not None and is_done(spec, step, state)
    # a run that is done trains nothing: its teacher endpoint (maybe shut down since) is not asked whether it is up
    trainer = build_trainer(spec, output_dir, [*callbacks, clock], check_teacher=not done)
    clock.not_training = lambda: trainer.eval_seconds
    # before anything of the run is discarded: a resume trains on the rows the run started on, or not at all
    new_rows = check_training_rows(output_dir, trainer.train_dataset, spec.data, resuming=ckpt is not None,
                                   main=trainer.accelerator.is_main_process)
    if stale := trainer.tracker.discard_after(step):
        log.warning("%s: %d tracker files of steps after %s were discarded (written after the last checkpoint, "
                    "or by an earlier run); those steps are trained again", output_dir, len(stale),
                    ckpt.name if ckpt is not None else "the start")
    if ckpt is None and resume:
        # decided together: a process that read spec.json after another rewrote it saw no earlier spec, but the
        # first to write had read it before (every process reads before it writes)
        from accelerate.utils import gather_object

        gathered = gather_object([(earlier, new_rows)])
        earlier = next((e for e, _ in gathered if e), [])
        new_rows = next((n for _, n in gathered if n), "")
    if not resume or (ckpt is None and (earlier or new_rows)):
        # starting over: nothing an earlier run left (fixed hints, checkpoints, model) is read
        trainer.hint_source.start_over(delete=trainer.accelerator.is_main_process)
        if earlier and resume:
            log.warning("%s: a run of another spec (%s) failed here before its first step: its hints are not "
                        "used", output_dir, "; ".join(earlier))
        elif new_rows and resume:
            log.warning("%s: a run failed here before its first step on other training rows (%s): its hints are "
                        "not used", output_dir, new_rows)
        if not resume and trainer.accelerator.is_main_process and (gone := remove_earlier_models(output_dir)):
            log.warning("%s: starting over, removed the earlier run's %s", output_dir, ", ".join(gone))
        trainer.accelerator.wait_for_everyone()
    if ckpt is not None:
        replayed = trainer.restore_state(step, ckpt)
        log.info("resuming %s from %s (%s)", output_dir, ckpt.name, f"{replayed} tracker records replayed" if replayed
                 else "per-prompt state from the checkpoint")
    final = output_dir / "final"
    keep = done and final_step(final) == step  # final/ is this checkpoint's model already
    if done and not keep and getattr(trainer, "is_deepspeed_enabled", False):
        # ZeRO shards load only inside HF's training loop: resume as before (it trains one more step)
        log.warning("%s: %s is done but final/ is not its model; under DeepSpeed it is loaded by resuming, which "
                    "trains one step more", output_dir, ckpt.name)
        done = False
    if not done:
        trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
    else:  # nothing left to train: HF's Trainer would train one step more past the checkpoint and save over final/
        log.warning("%s: %s is done (max_steps %d%s): nothing to train; %s", output_dir, ckpt.name,
                    spec.max_steps, f", rollout_budget {spec.rollout_budget}" if spec.rollout_budget else "",
                    "final/ is its model" if keep else "final/ is written from it")
        trainer.state = state
        if not keep:
            trainer._load_from_checkpoint(str(ckpt))
    if not keep:
        if spec.lora_r is None:
            trainer.save_model(str(final))
        else:  # the adapters, then the full model they make with the base (sage_core.lora)
            trainer.save_model(str(output_dir / ADAPTER_DIR))
            if trainer.accelerator.is_main_process:
                merge_adapter(spec, output_dir / ADAPTER_DIR, final)
            trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            trainer.processing_class.save_pretrained(str(final))
            (final / FINAL_STEP_FILE).write_text(json.dumps({"global_step": trainer.state.global_step}))
    trainer.accelerator.wait_for_everyone()  # final/ whole before it is uploaded
    if trainer.accelerator.is_main_process:  # the model trained (final/), to each tracking callback's run
        for cb in callbacks:
            if hasattr(cb, "log_final_model"):
                cb.log_final_model(final, trainer.state.global_step)
    wall = clock.wall_seconds()  # every session's, model loading and saving included
    history = list(trainer.state.log_history)
    summary = summarize(history, trainer.tracker)
    # a resumed run: its earlier sessions' training time too (all of it, where this session trained nothing)
    summary["train_seconds"] = clock.before if done else summary["train_seconds"] - trainer.eval_seconds + clock.before
    summary["wall_seconds"] = wall
    if trainer.accelerator.is_main_process:  # the main process's times (each process measures its own)
        TrainTime.record_wall(output_dir / f"checkpoint-{trainer.state.global_step}", wall)
        (output_dir / "summary.json").write_text(json.dumps(strict_json(summary), indent=2, allow_nan=False))
    release_vllm(trainer)
    return TrainResult(output_dir, final, Path(trainer.args.tracker_dir), trainer.state.global_step, wall,
                       summary, history)


def release_vllm(trainer) -> None:
    """Shut a colocated vLLM engine down once every rank is done with it. vLLM's teardown destroys its process
    groups and the default one; left to interpreter exit it runs after shutdown_distributed has destroyed the
    default group, and every rank prints 'ValueError: Invalid process group specified'. It also frees the engine's
    memory for whatever runs next in this process (another method of a benchmark, say)."""
    import torch.distributed as dist

    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)  # colocate mode (server mode: a client)
    if llm is None:
        return
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    llm.llm_engine.engine_core.shutdown()


def shutdown_distributed() -> None:
    """End a multi-process run cleanly: wait for every rank, then destroy the process group. Left to interpreter
    exit, gloo's threads can be torn down mid-flight and abort the process (std::terminate, SIGABRT)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def strict_json(obj: Any) -> Any:
    """`obj` (a summary, or train_result.json's dict with its log history and eval records) as strict JSON takes
    it: a number that is not one (NaN: nothing measured) is null, in nested dicts and lists too; Python's json
    writes a bare NaN that jq, JavaScript and most other readers refuse."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def summarize(history: list[dict], tracker) -> dict[str, float]:
    """The numbers that matter for a run, from its log history and per-prompt tracker."""
    steps = [h for h in history if "sage/frac_collapsed" in h]

    def mean(key):
        vals = [h[key] for h in steps if h.get(key) is not None and h[key] == h[key]]
        return sum(vals) / len(vals) if vals else float("nan")

    def total(key):
        return sum(h.get(key, 0) or 0 for h in steps)

    def last_eval(stat):  # the last no-hint eval while training (eval_every), NaN without one
        return next((v for h in reversed(history) for k, v in h.items()
                     if k.startswith("eval/during/") and f"/{stat}_at_" in k), float("nan"))

    return {
        "never_solved": tracker.never_solved(),
        "never_solved_no_hint": tracker.never_solved_no_hint(),
        "prompts_seen": float(len(tracker.seen)),
        "frac_collapsed": mean("sage/frac_collapsed"),
        "frac_rescued": mean("sage/frac_rescued"),
        "rescued": total("sage/rescued_groups"),
        "rollouts": total("sage/rollouts"),
        # work done, machine-independent: completion tokens generated (rollouts, re-rolls, hints) and tokens trained
        "gen_tokens": total("sage/gen_tokens"),
        "train_tokens": total("sage/train_tokens"),
        # learning signal: trained groups whose gate was open (mixed rewards), summed over steps
        "open_groups": total("sage/open_groups"),
        # where the time went: rolling out (first rollout and re-rolls) and writing hints; the rest is the update
        "gen_seconds": total("sage/gen_seconds"),
        "hint_seconds": total("sage/hint_seconds"),
        # the no-hint eval every eval_every steps (not in train_seconds); logged with any step, not only a batch's first
        "eval_seconds": sum(h.get("sage/eval_seconds", 0) or 0 for h in history),
        "eval_avg_at_k": last_eval("avg"),
        "eval_pass_at_k": last_eval("pass"),
        # sequential generate calls: rollout passes (first rollout + re-roll rounds) and hint-writing passes
        "rollout_passes": total("sage/rollout_passes"),
        "hint_passes": total("sage/hint_passes"),
        # activation memory (measure_activations): the largest step mean of bytes saved for backward per micro-batch
        "activation_mb": max((h["sage/activation_mb"] for h in steps if "sage/activation_mb" in h),
                             default=float("nan")),
        "reward": mean("reward"),
        "step_time": mean("step_time"),
        # the training loop alone (no model loading, no saving): what method-to-method cost ratios compare
        "train_seconds": next((h["train_runtime"] for h in history if "train_runtime" in h), float("nan")),
    }
