"""RunSpec: the one typed description of a training run, shared by the CLI, the Prefect flows and the trainer.

Pydantic validates it, so a bad value is rejected when a Prefect run is created (server-side JSON schema) and
when the CLI parses it, with a message that names the field.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Method = Literal["grpo", "sage", "sage-light", "dapo-filter", "ada-seq", "ada-est", "sage-light+ada-seq"]
HintSourceName = Literal["online", "fixed", "teacher"]
Weighting = Literal["none", "linear", "log", "arcsin-sqrt"]
HINTING_METHODS = ("sage", "sage-light", "sage-light+ada-seq")  # the methods that write and use hints


class RunSpec(BaseModel):
    """Everything that defines a run. Defaults are an offline tiny run: the tiny-cpu preset (where every `sage`
    command's spec starts unless --preset names another) but for max_steps (20 here, 12 there) and lookahead (off
    here, on there)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf lr or temperature: NaN weights

    # what to train
    model: str = Field("tiny", min_length=1,
                       description="'tiny' (built offline), a local path, an HF id, or a .gguf file path")
    gguf_file: str | None = Field(None, description="GGUF file name inside `model` (transformers gguf_file)")
    data: str = Field("synthetic", min_length=1,
                      description="'synthetic', a .parquet/.jsonl file, or an HF dataset name")
    data_split: str = "train"
    num_prompts: int = Field(64, ge=1, description="synthetic task size / max rows taken from a file")
    difficulty: Literal["mixed", "easy", "hard"] = "mixed"

    # the algorithm
    method: Method = "sage"
    hint_source: HintSourceName = "online"
    teacher: str | None = Field(None, description="teacher hints: a model path, an http(s) OpenAI-compatible URL, "
                                                  "or a .jsonl/.parquet file of precomputed hints")
    teacher_model: str | None = Field(None, description="model name sent to an OpenAI-compatible teacher endpoint")
    hint_max_tokens: int = Field(48, ge=4)
    hint_retries: int = Field(2, ge=0, description="extra hint samples when a hint leaks or is empty")
    hint_temperature: float = Field(0.0, ge=0.0, description="first hint sample's temperature (0 = greedy)")
    light_min: float = Field(0.1, ge=0.0, le=1.0, description="SAGE-LIGHT: raise level when accuracy <= this")
    light_max: float = Field(0.35, ge=0.0, le=1.0, description="SAGE-LIGHT: lower level when accuracy > this")
    weighting: Weighting = Field("none", description="prompt objective f(p) the update climbs: each trained "
                                 "group's advantages are scaled by an estimate of f'(p) p (1-p) made from its rewards "
                                 "(sage_core/curation.py; not f'(p) itself: the std division already gives "
                                 "1/(p(1-p)), so 'linear' is not plain GRPO). 'none': the method's own, plain "
                                 "advantages but for ada-seq, ada-est and sage-light+ada-seq, which train log p "
                                 "(Reinforce-Ada's objective)")
    max_rounds: int = Field(4, ge=1, description="dapo-filter / ada-seq / sage-light+ada-seq: tries per prompt and "
                                                 "step, the first included; ada-est: its most rounds for a prompt")
    lookahead: bool = Field(False, description="roll the search's next levels (and ada-est's allotted rounds) in "
                                               "the same pass when it stays no wider than the first rollout: fewer "
                                               "sequential passes for some unasked rollouts (counted as spent). On "
                                               "in the tiny-cpu preset (SAGE -13-15% time there); unmeasured on GPUs")
    rollout_budget: int | None = Field(None, ge=1, description="stop once this many completions were rolled out "
                                                               "(compare methods on equal sampling cost)")

    # GRPO / optimisation
    num_generations: int = Field(8, ge=2, description="G, rollouts per prompt")
    prompts_per_step: int = Field(8, ge=1)
    max_steps: int = Field(20, ge=1, description="rollout batches (generation steps)")
    updates_per_generation: int = Field(1, ge=1, description="optimizer steps per rollout batch (paper: 2)")
    micro_batch_size: int | None = Field(None, ge=1, description="rows per forward/backward; None: all at once")
    length_buckets: bool = Field(True, description="forward the loss on length buckets of a micro-batch, each "
                                                    "trimmed of shared padding (same loss, fewer padded tokens)")
    skip_zero_advantage: bool = Field(True, description="no backward through rows whose advantage is 0 (exact "
                                                         "with beta 0 and no entropy bonus; needs length_buckets)")
    hint_drafts: bool = Field(True, description="check each greedy hint (HF generate) against the request's last "
                                                "hint in one forward before decoding it (the same hints, fewer "
                                                "decode loops)")
    hint_prefetch: bool = Field(False, description="with hint_drafts, online greedy hints: the next step's hint "
                                                    "requests decode greedily in this step's rollout pass, as their "
                                                    "drafts (the same hints, fewer decode loops; for GPUs, not "
                                                    "measured there yet: on CPU it costs more than it saves)")
    shared_prefix: bool = Field(True, description="compute each distinct prompt once in the loss's forward, for all "
                                                   "rows that share it (same loss and gradients; needs length_buckets)")
    shared_prefill: bool = Field(True, description="HF generate: prefill each distinct prompt once for all rows that "
                                                    "repeat it (the same logits up to float rounding)")
    measure_activations: bool = Field(False, description="log sage/activation_mb: the bytes the loss's forward saves "
                                                         "for backward per micro-batch (the activation memory)")
    learning_rate: float = Field(1e-4, gt=0.0)
    lora_r: int | None = Field(None, ge=1, description="LoRA rank: train adapters on the linear layers instead of "
                                                       "all weights (final/ is the merged model); None: full "
                                                       "fine-tuning")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling numerator (the update is scaled by alpha / r)")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_target_modules: str = Field("all-linear", min_length=1,
                                     description="'all-linear' (every linear layer but the output head) or "
                                                 "comma-separated module names, e.g. 'q_proj,v_proj'")
    max_prompt_length: int | None = Field(None, ge=1, description="longest prompt in tokens, hint not counted: longer "
                                          "rows are left out at load; with hint_max_tokens, the hint header and "
                                          "max_completion_length it sizes vLLM's context")
    max_completion_length: int = Field(40, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    epsilon: float = Field(0.2, ge=0.0, description="PPO clip: ratio >= 1 - epsilon")
    epsilon_high: float = Field(0.28, ge=0.0, description="PPO clip: ratio <= 1 + epsilon_high (DAPO's clip-higher)")
    beta: float = Field(0.0, ge=0.0, description="KL penalty coefficient (0: no reference model)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    seed: int = Field(0, ge=0, description="seed of the synthetic prompts, the held-out set and training")
    save_steps: int = Field(10, ge=1)
    keep_checkpoints: int | None = Field(2, ge=1, description="checkpoint-N folders kept on disk, the newest (a "
                                                              "resume needs one); None: every one, to evaluate "
                                                              "later (sage eval --model RUN/checkpoint-N)")
    gradient_checkpointing: bool = False
    bf16: bool | None = Field(None, description="None: on for CUDA, off on CPU")

    # generation back-end
    use_vllm: bool = False
    vllm_mode: Literal["colocate", "server"] = "colocate"
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0)
    vllm_server_base_url: str | None = None

    # evaluation (no hint)
    eval_k: int = Field(4, ge=1)
    eval_num_prompts: int = Field(32, ge=1)
    eval_temperature: float = Field(0.6, ge=0.0, description="0 = greedy")
    eval_top_p: float = Field(0.95, gt=0.0, le=1.0)
    eval_every: int | None = Field(None, ge=1, description="during training, every this many steps (and at the "
                                   "last): no-hint avg@k / pass@k of the policy on the held-out set, as MLflow metrics "
                                   "eval/during/<set>/avg_at_<k>, pass_at_<k>; it does not change training (its "
                                   "sampling has its own RNG)")
    eval_data: str | None = Field(None, min_length=1, description="the set eval_every scores: 'synthetic' (held-out "
                                  "synthetic rows), a .parquet/.jsonl file or a data set (its test, else validation, "
                                  "else train split), its first eval_num_prompts rows; None, 'heldout' or `data` "
                                  "itself: the held-out rows of `data`")

    @model_validator(mode="after")
    def _check(self) -> "RunSpec":
        if self.light_min > self.light_max:
            raise ValueError(f"light_min ({self.light_min}) must be <= light_max ({self.light_max})")
        if self.hint_source == "teacher" and not self.teacher and self.method in ("sage", "sage-light",
                                                                                 "sage-light+ada-seq"):
            raise ValueError("hint_source='teacher' needs `teacher` (model path, endpoint URL or hints file)")
        if why := teacher_url_error(self.teacher):
            raise ValueError(why)
        if self.data_split != "train" and (self.data == "synthetic" or Path(self.data).suffix.lower() in (
                ".parquet", ".jsonl", ".json")):
            raise ValueError(f"data_split={self.data_split!r} picks a split of a data set (a folder or an HF name); "
                             f"data {self.data!r} has none (a file's rows are all read): drop data_split")
        if self.gguf_file is not None and (self.model in ("tiny", "smollm2") or self.model.lower().endswith(".gguf")):
            what = "a .gguf file itself" if self.model.lower().endswith(".gguf") else "built in"
            raise ValueError(f"gguf_file={self.gguf_file!r} names a file inside the model folder, and model "
                             f"{self.model!r} is {what}: drop gguf_file (or set model to the folder that holds it)")
        rows = self.prompts_per_step * self.num_generations  # one step's rollouts (over all processes)
        micro = self.micro_batch_size or rows
        if rows % micro:
            raise ValueError(f"micro_batch_size ({micro}) must divide prompts_per_step x num_generations "
                             f"({self.prompts_per_step} x {self.num_generations} = {rows} rows a step)")
        if (rows // micro) % self.updates_per_generation:
            what = f"the {rows // micro} micro-batches of a step" if self.micro_batch_size else \
                "1 (no micro_batch_size: a step is one batch)"
            raise ValueError(f"updates_per_generation ({self.updates_per_generation}) must divide {what}")
        return self

    def key(self) -> str:
        """A stable hash of the spec, used for caching and for finding the MLflow run of a spec. Fields that do not
        change what is trained and were added after runs existed (NOT_IN_KEY) are left out: a run keeps its key."""
        fields = {k: v for k, v in self.model_dump().items() if k not in NOT_IN_KEY}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def uses_hints(self) -> bool:
        return self.method in HINTING_METHODS


def teacher_url_error(teacher: str | None) -> str | None:
    """Why a teacher endpoint URL is refused, or None: one with a user, a password, a query or a fragment. The URL
    is recorded (spec.json, the MLflow params, the Prefect parameters, each `sage hints` row's teacher, error
    messages), so a key in it would be too; the key goes in SAGE_TEACHER_API_KEY. A teacher that is no URL: None."""
    if not teacher or not teacher.startswith(("http://", "https://")):
        return None
    from urllib.parse import urlsplit

    try:
        u = urlsplit(teacher)
    except ValueError as e:
        return f"teacher URL: {e}"
    if "@" in u.netloc or u.query or u.fragment or teacher.rstrip().endswith(("?", "#")):
        return (f"teacher {u.scheme}://{u.hostname}...: give the endpoint's base URL with no user, password or "
                "query (e.g. http://host:8000/v1; it is recorded in spec.json, MLflow and the hints files): an API "
                "key goes in SAGE_TEACHER_API_KEY")
    return None


def layout_error(spec: RunSpec, world: int) -> str | None:
    """Why `spec` cannot train on `world` processes, or None when it can: every process rolls out the same number
    of rows, whole prompt groups only, in micro-batches that divide them, updates_per_generation dividing those (the
    trainer's config and `sage launch`'s layouts both check this)."""
    G = spec.num_generations
    rows = spec.prompts_per_step * G
    if world < 1:
        return f"the process count must be >= 1, got {world}"
    if rows % world:
        return (f"prompts_per_step x num_generations = {spec.prompts_per_step} x {G} = {rows} rows a step do not "
                f"split over {world} processes")
    local = rows // world
    micro = spec.micro_batch_size or local
    if local % micro:
        return f"micro_batch_size ({micro}) must divide the {local} rows each of {world} processes rolls out per step"
    if (local // micro) % spec.updates_per_generation:
        return (f"updates_per_generation ({spec.updates_per_generation}) must divide the {local // micro} "
                f"micro-batches of a step on each of {world} processes")
    if local % G:
        return (f"each of {world} processes rolls out {local} rows a step, not a multiple of num_generations ({G}): "
                "every prompt's group must live on one process; use a prompts_per_step that is a multiple of the "
                "process count")
    return None


# RunSpec fields a run may change when it continues in its output dir: when it stops and saves, how it is evaluated,
# where and in how much memory vLLM runs. A change to any other field makes it another run.
RESUMABLE_FIELDS = frozenset({"max_steps", "save_steps", "keep_checkpoints", "rollout_budget", "eval_k",
                              "eval_num_prompts", "eval_temperature", "eval_top_p", "eval_every", "eval_data",
                              "vllm_server_base_url", "vllm_gpu_memory_utilization", "shared_prefix",
                              "shared_prefill", "hint_drafts", "hint_prefetch"})
# the same run, trained the same, with or without them: evaluation while training (on whichever set), how many
# checkpoints stay on disk, how the loss's forward lays out its rows (shared prompts: the same gradients), whether
# greedy hints are checked against drafts first, and whether those drafts are written ahead (the same hints)
NOT_IN_KEY = frozenset({"eval_every", "eval_data", "keep_checkpoints", "shared_prefix", "shared_prefill",
                        "hint_drafts", "hint_prefetch"})


PATH_FIELDS = ("model", "data", "teacher", "eval_data")  # a local path, a built-in name, a hub id or (teacher) a URL
BUILT_IN_NAMES = frozenset({"tiny", "smollm2", "synthetic", "heldout"})  # heldout: eval_data's keyword


def absolute_path(value):
    """A path field's value as an absolute path where it names a file or folder that exists here (a relative one is
    taken from the working directory); a built-in name, a URL, a hub id or a path not here as it is."""
    if not isinstance(value, str) or not value or value in BUILT_IN_NAMES or "://" in value:
        return value
    p = Path(value).expanduser()
    if p.exists():
        return os.path.abspath(p)
    folder, colon, config = value.rpartition(":")  # a local dataset folder with its configuration (NAME:CONFIG)
    if colon and folder and Path(folder).expanduser().is_dir():
        return f"{os.path.abspath(Path(folder).expanduser())}:{config}"
    return value


def with_absolute_paths(spec: RunSpec) -> RunSpec:
    """`model`, `data`, `teacher` and `eval_data` (PATH_FIELDS) given as relative local paths made absolute where
    the spec is built (the CLI's working directory, a flow's worker): spec.json, the spec key and a resume from
    another working directory then name the same files, not whichever have those names there."""
    update = {f: a for f in PATH_FIELDS if (a := absolute_path(getattr(spec, f))) != getattr(spec, f)}
    return spec.model_copy(update=update) if update else spec


class RunFolderTaken(ValueError):
    """An output dir that holds a run of another spec; the message names the folder and the changed fields."""


def check_run_folder(spec: RunSpec, out: str | Path) -> None:
    """Raise RunFolderTaken when `out` holds a run (checkpoints, tracker files or a final model: has_trained)
    whose spec.json records another spec (fields outside RESUMABLE_FIELDS differ): training there would resume that
    run under the new spec, or without resuming overwrite its checkpoints, tracker and final model; so does a folder
    holding checkpoints without a spec.json (another trainer's). A folder left by a run that failed before its first
    step, or with an unreadable spec.json, passes; a folder that is no run's is refused when it holds a file training
    writes over."""
    out = Path(out)
    if not out.is_dir():
        return
    if not has_trained(out):
        # not a run: fine, unless it holds files a run writes over (TRL's model card README.md, summary.json)
        mine = [n for n in ("README.md", "summary.json") if (out / n).exists()]
        # and a spec.json no run wrote (a run writes every field: a user's --spec file, say) that is not this spec
        recorded = recorded_fields(out)
        if recorded is not None and set(recorded) != set(RunSpec.model_fields) and (
                changed := file_changes(spec, recorded)):
            mine.append(f"spec.json (not one a run wrote: a --spec file? this spec differs: {'; '.join(changed)})")
        if mine:
            raise RunFolderTaken(f"{out} is not a run's folder and holds {', '.join(mine)}, which training writes "
                                 "over: pick another output dir")
        return
    if not (out / "spec.json").exists():  # every SAGE run writes one before its first step
        raise RunFolderTaken(f"{out} holds checkpoints, tracker files or a final model but no spec.json: not a SAGE "
                             "run's folder (another trainer's output dir?), which training would resume from or, "
                             "with --no-resume, delete: pick another output dir")
    if changed := spec_changes(spec, out):
        raise RunFolderTaken(f"{out} holds a run of another spec ({'; '.join(changed)})")


RUN_LOCK = ".sage_train.lock"  # in a run folder: locked (flock) by the process training there, its pid inside
HELD_ENV = "SAGE_RUN_FOLDER_HELD"  # a run folder `sage launch` holds for the ranks it starts (they take no hold)
_HELD: set[tuple[Path, int]] = set()  # (run folder, thread) this process holds: a nested hold is the same one


@contextlib.contextmanager
def run_folder_lock(out: str | Path):
    """Hold run folder `out` (`<out>/.sage_train.lock`, made with the folder) while this process trains there: a
    second `sage train` or train() into a folder another process (or thread) holds raises RunFolderTaken naming it
    and the process, before it opens an MLflow run or touches the folder. Two at once trained the same steps into
    one folder's checkpoints and tracker files, each in an MLflow run of its own (mlflow_run_id named one), and a
    --no-resume one deleted the other's checkpoints. A hold nested in the same thread (the CLI's, then train()'s)
    is the one already held, as is one `sage launch` holds for its ranks (HELD_ENV). Only the main process
    (RANK 0) takes it: every rank of a launch trains there. The
    kernel drops it when the process ends, SIGKILL included (the file stays, unlocked)."""
    out = Path(out).resolve()
    me = (out, threading.get_ident())
    if int(os.environ.get("RANK", "0")) != 0 or me in _HELD or os.environ.get(HELD_ENV) == str(out):
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RUN_LOCK, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip()
            raise RunFolderTaken(f"{out} is being trained by another process{f' (pid {holder})' if holder else ''}: "
                                 "wait for it to end (it resumes from its checkpoints), or train in another output "
                                 "dir") from None
        except OSError as e:  # a cluster's file system without flock (Lustre mounted without it, NFS without lockd:
            # ENOLCK, EOPNOTSUPP, ENOSYS): train unheld, as before the lock, rather than not at all
            logging.getLogger(__name__).warning("%s: not held against a second trainer: its file system does not "
                                                "lock files (%s)", out, e.strerror or e)
            yield
            return
        fh.truncate(0)
        fh.write(str(os.getpid()))
        fh.flush()
        _HELD.add(me)
        try:
            yield
        finally:
            _HELD.discard(me)
            fh.truncate(0)  # the lock goes with the file's close


def has_trained(out: str | Path) -> bool:
    """Whether `out` holds what a run trained: checkpoints, tracker files or a final model. An MLflow run id alone
    (`mlflow_run_id`, written before the first step) is no run."""
    out = Path(out)
    return any(out.glob("checkpoint-*")) or any(out.glob("tracker/*.parquet")) or (out / "final").exists()


def recorded_fields(out: str | Path) -> dict | None:
    """The fields a run recorded in `<out>/spec.json` (train() writes it before the first step), as the file has
    them; None where there is none or it is unreadable (not JSON, or not an object). The one reader of that file:
    recorded_spec validates what it returns, spec_changes compares it field by field."""
    try:
        fields = json.loads((Path(out) / "spec.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none, or unreadable
        return None
    return fields if isinstance(fields, dict) else None


def recorded_beside(model_ref: str | Path) -> dict | None:
    """The fields recorded by the run a model folder is part of: the spec.json in it or in its parent (a run's
    final/ and checkpoint-N/ lie beside it), {} where that file is unreadable; None for a model no run here trained
    (not a folder, or no spec.json by it)."""
    folder = Path(model_ref).expanduser()
    if not folder.is_dir():
        return None
    run = next((f for f in (folder, folder.parent) if (f / "spec.json").is_file()), None)
    return None if run is None else recorded_fields(run) or {}


def recorded_spec(out: str | Path) -> RunSpec | None:
    """The RunSpec recorded in `<out>/spec.json` (fields it lacks at their defaults); None where there is none or it
    is unreadable, including one this RunSpec refuses (a field it does not have, a value out of its bounds)."""
    return spec_from_fields(recorded_fields(out))


def spec_from_fields(fields: dict | None) -> RunSpec | None:
    """The RunSpec of fields recorded in a spec.json (recorded_fields); None for none, or ones this RunSpec refuses."""
    if fields is None:
        return None
    try:
        return RunSpec.model_validate(fields)
    except ValueError:  # pydantic's ValidationError
        return None


def spec_changes(spec: RunSpec, out: str | Path) -> list[str]:
    """The fields outside RESUMABLE_FIELDS where `spec` differs from the spec.json in `out`, as `field old -> new`
    (a field the file lacks counts as its default); none where there is no readable spec.json. The file's values
    are compared as recorded, so one this RunSpec would refuse (an older version's) still counts as a change."""
    if (old := recorded_fields(out)) is None:
        return []
    new = json.loads(spec.model_dump_json())
    return [f"{k} {old.get(k, f.default)!r} -> {new[k]!r}" for k, f in RunSpec.model_fields.items()
            if k not in RESUMABLE_FIELDS and _differs(k, old.get(k, f.default), new[k])]


def file_changes(spec: RunSpec, fields: dict) -> list[str]:
    """The fields a spec file names (a user's, not a run's: it may name only some) that `spec` does not have at the
    file's values, resumable ones included, as `field file -> spec`."""
    new = json.loads(spec.model_dump_json())
    return [f"{k} {v!r} -> {new[k]!r}" if k in new else f"{k} {v!r} (no such field)" for k, v in fields.items()
            if k not in new or _differs(k, v, new[k])]


def _differs(field: str, was, now) -> bool:
    """Whether a recorded value is not the spec's; a path recorded relative (before paths were made absolute) is
    the file it names from here."""
    return was != now and not (field in PATH_FIELDS and absolute_path(was) == now)
