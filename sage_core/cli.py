"""`sage`: the command line of SAGE Studio.

    sage presets                                   list the named presets
    sage spec  --preset tiny-cpu [--set k=v ...]   print the validated RunSpec as JSON
    sage train --preset tiny-cpu [--spec f.json] [--set k=v ...] [--output-dir DIR] [--mlflow]
    sage eval  --model PATH|RUN --benchmark name=path [--benchmark ...] [--k 4] [--num-prompts 32]
    sage hints --teacher URL|PATH --out hints.jsonl [--levels 1,2,3]   a teacher's hints for the spec's prompts
    sage launch --preset qwen2.5-7b [--gpus 0,1,...] [--config zero3] [--vllm-mode server] [--dry-run]

A spec is built in three layers: the preset (tiny-cpu unless --preset names another), then the JSON file given
with --spec, then each --set. An invalid value exits with code 2 and a message naming the field. Heavy imports
(torch, trl, mlflow) happen only inside the command that needs them, so `sage --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import re
import select
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any

from .atomic import atomic_path, move_new, write_text_atomic
from .data import DataError
from .hints import TeacherError
from .lora import LoraTargetsNotFound
from .models import ModelNotFound

EXIT_USAGE = 2
DEFAULT_PRESET = "tiny-cpu"  # every command's spec starts from it unless --preset names another


class SpecError(Exception):
    """A spec that cannot be built; the message is shown as is and the exit code is 2."""


# ---------------------------------------------------------------------------------------------- spec building
def parse_sets(pairs: list[str] | None) -> dict[str, Any]:
    """`key=value` strings to a dict. Values stay strings (pydantic coerces '5', '1e-6', 'true' to the field's
    type); 'none'/'null' become None for a field that takes None. Unknown keys are rejected with a suggestion."""
    from .spec import RunSpec

    fields = RunSpec.model_fields
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SpecError(f"--set expects key=value, got {pair!r}")
        key, value = (x.strip() for x in pair.split("=", 1))  # `lookahead= false` (a shell line's space) as `=false`
        key = key.replace("-", "_")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise SpecError(f"unknown RunSpec field {key!r} in --set {pair!r}{hint}")
        out[key] = None if value.lower() in ("none", "null") and _takes_none(fields[key]) else value
    return out


def _takes_none(field) -> bool:
    """Whether a RunSpec field can be None (`--set rollout_budget=none`); for a field that cannot, 'none' is the
    value itself (`--set weighting=none`, a choice of its own) or refused by the field's own check."""
    return field.annotation is None or type(None) in typing.get_args(field.annotation)


def load_spec_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"--spec: no such file {str(p)!r}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SpecError(f"--spec {str(p)!r} is not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"--spec {str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"--spec {str(p)!r} must hold a JSON object of RunSpec fields")
    return data


def format_validation_error(err: Exception) -> str:
    """A pydantic ValidationError as one line per field: `  - field: message (got value)`."""
    lines = ["invalid run spec:"]
    for e in err.errors():  # type: ignore[attr-defined]
        loc = ".".join(str(x) for x in e.get("loc", ())) or "spec"
        msg = e.get("msg", "invalid")
        msg = msg.removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if loc == "spec" or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  - {loc}: {msg}{shown}")
    return "\n".join(lines)


def build_spec(preset: str | None = None, spec_file: str | None = None, sets: list[str] | None = None):
    """preset -> spec file -> --set, validated. Raises SpecError with a readable message."""
    from pydantic import ValidationError

    from .presets import PRESETS
    from .spec import RunSpec

    fields: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            close = difflib.get_close_matches(preset, list(PRESETS), n=2)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SpecError(f"unknown preset {preset!r}{hint}; choose one of {', '.join(PRESETS)}")
        fields.update(PRESETS[preset])
    if spec_file is not None:
        fields.update(load_spec_file(spec_file))
    fields.update(parse_sets(sets))
    from .spec import with_absolute_paths

    try:
        return with_absolute_paths(RunSpec(**fields))
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from None


REPO_ROOT = Path(__file__).resolve().parents[1]


def sage_home() -> Path:
    """`SAGE_HOME`, default `<repo>/.sage` (as sage_core.tracking and sage_core.models)."""
    return Path(os.environ.get("SAGE_HOME") or REPO_ROOT / ".sage").expanduser().resolve()


def default_output_dir(spec) -> Path:
    """`$SAGE_HOME/runs/<method>-<spec key>`: the same spec resumes in the same folder."""
    return sage_home() / "runs" / f"{spec.method}-{spec.key()}"


def check_run_dir(spec, out: Path) -> None:
    """Refuse, before anything is written, a training run that cannot start or would write over another run: fewer
    prompts than a step draws, an output dir that is not a folder, or one that holds a run of another spec
    (sage_core.spec.check_run_folder, which train() itself checks too)."""
    from .spec import RunFolderTaken, check_run_folder

    if spec.num_prompts < spec.prompts_per_step:
        raise SpecError(f"num_prompts ({spec.num_prompts}) is fewer than prompts_per_step ({spec.prompts_per_step}): "
                        "no training step could be drawn; raise num_prompts or lower prompts_per_step")
    if out.exists() and not out.is_dir():
        raise SpecError(f"--output-dir {out}: exists and is not a folder")
    try:
        check_run_folder(spec, out)
    except RunFolderTaken as e:
        raise SpecError(f"--output-dir {e}; train in another --output-dir (without one, each spec gets its own "
                        "folder), or delete this one to start over") from None


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "to_dict") and callable(obj.to_dict):  # e.g. a pandas DataFrame
        try:
            return _jsonable(obj.to_dict(orient="records"))
        except TypeError:
            return _jsonable(obj.to_dict())
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    return repr(obj)


def result_dict(result: Any) -> dict[str, Any]:
    """TrainResult (a dataclass: output_dir, checkpoint_dir, tracker_dir, global_step, wall_seconds, summary,
    eval) as a JSON-able dict."""
    d = _jsonable(result)
    if not isinstance(d, dict):
        d = {k: _jsonable(getattr(result, k, None)) for k in ("output_dir", "checkpoint_dir", "tracker_dir",
                                                                "global_step", "wall_seconds", "summary", "eval")}
    return d


# ---------------------------------------------------------------------------------------------- commands
def _forget_run_id(spec, out: Path, fresh: bool = False) -> None:
    """Remove `<output_dir>/mlflow_run_id` where the run it names is not the one to log into: a run started over
    (`fresh`, --no-resume), or one that failed before its first step under another spec (sage_core.spec)."""
    from .spec import has_trained, spec_changes
    from .tracking import RUN_ID_FILE

    if fresh or not has_trained(out) and spec_changes(spec, out):
        (out / RUN_ID_FILE).unlink(missing_ok=True)


def _open_tracking(spec, out: Path, args: argparse.Namespace) -> tuple[list, str | None]:
    """(callbacks, run id this command owns). A run id in SAGE_MLFLOW_RUN_ID (set by `sage launch --mlflow` or a
    flow that opened the run itself) is logged into but not closed here; with --mlflow and no such id, the main
    process opens (or, after a crash, reopens) the run recorded in `<output_dir>/mlflow_run_id`, or a new one with
    --no-resume or where that run failed before its first step under another spec."""
    if os.environ.get("SAGE_MLFLOW_RUN_ID"):
        from .tracking import callback_from_env

        return [callback_from_env()], None
    if not args.mlflow or not _is_main_process():
        if args.no_resume and _is_main_process():  # the run it names logged the trajectory started over now: a
            _forget_run_id(spec, out, fresh=True)  # later --mlflow opens a new run, never that one
        return [], None
    from . import tracking

    _forget_run_id(spec, out, fresh=args.no_resume)
    rid, resumed = tracking.resume_or_create_run(spec, "train", out, experiment=args.experiment)
    print(f"sage train: MLflow run {rid}{' (resumed)' if resumed else ''} at {tracking.shown_uri()}",
          flush=True)
    return [tracking.MlflowTrackingCallback(run_id=rid, output_dir=out)], rid


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit or scancel, Kubernetes' eviction, `kill`), raised by `_sigterm_raises` in
    the main thread: the run unwinds as on Ctrl-C (a KeyboardInterrupt, so each `except KeyboardInterrupt` takes it
    for a stop), its cleanup runs and its MLflow run ends KILLED, where Python's default would exit at once and
    leave that run RUNNING with no end time."""


@contextlib.contextmanager
def _sigterm_raises(command: str):
    """While the block runs, SIGTERM raises Terminated in the main thread (elsewhere no handler can be set: nothing
    changes); the block's Terminated becomes `sage COMMAND: stopped by SIGTERM` and exit code 143 (128 + 15, as a
    shell reports a process SIGTERM ended). A second SIGTERM gets the earlier handler (the default ends the process
    at once), and that handler is put back after the block. Under `accelerate launch` every rank gets it and stops;
    only the main process touches MLflow."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: set outside Python, taken as the default

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, previous)
        raise Terminated("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except Terminated:
        print(f"sage {command}: stopped by SIGTERM", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _end_run(run_id: str | None, error: BaseException) -> None:
    """End the MLflow run this command opened, by the error that ended it: KILLED when stopped, FAILED otherwise."""
    if run_id is not None:
        from .tracking import end_status, finish_run

        try:
            finish_run(run_id, status=end_status(error))
        except Exception as why:  # noqa: BLE001 - a store that refuses it (the error that ended training is raised)
            print(f"sage: MLflow run {run_id} could not be ended ({type(why).__name__}: {str(why).splitlines()[0]})",
                  file=sys.stderr, flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    spec = build_spec(args.preset, args.spec, args.set)
    out = Path(args.output_dir).resolve() if args.output_dir else default_output_dir(spec)
    check_run_dir(spec, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(f"--output-dir {out}: cannot be created ({e.strerror})") from None
    from .spec import RunFolderTaken, run_folder_lock

    try:  # held from before the MLflow run is opened (or forgotten, with --no-resume) to the result's file
        with run_folder_lock(out):
            return _train_in(spec, out, args)
    except RunFolderTaken as e:  # another process trains there
        raise SpecError(f"--output-dir {e}") from None


def _train_in(spec, out: Path, args: argparse.Namespace) -> int:
    """cmd_train in its run folder, held (spec.run_folder_lock)."""
    if _is_main_process():
        print(f"sage train: method={spec.method} model={spec.model} steps={spec.max_steps} -> {out}", flush=True)
    callbacks, run_id = _open_tracking(spec, out, args)
    from .train import LayoutError, shutdown_distributed, strict_json, train

    with _sigterm_raises("train"):
        try:
            result = train(spec, out, callbacks=callbacks, resume=not args.no_resume)
            shutdown_distributed()
            d = result_dict(result) if _is_main_process() else {}  # with log_history: a flow may log it afterwards
            if run_id is not None:
                from .tracking import log_summary

                log_summary(d.get("summary") or {}, run_id=run_id)
        except BaseException as e:
            _end_run(run_id, e)
            if isinstance(e, LayoutError):  # the spec does not split over the processes this run was started with
                raise SpecError(str(e)) from None
            if (full := _disk_full(out, e)) is not None:  # torch's error for it names neither the disk nor the path
                print(f"sage train: writing to {out} failed: {full} ({type(e).__name__}: {str(e).strip()[:200]}); what "
                      "was saved before stays: make room, then run the same command again (it resumes from the last "
                      "whole checkpoint)", file=sys.stderr, flush=True)
                return 1
            raise  # a TrackingError (trained and saved; the store refused the last logs, kept): said by main
        if run_id is not None:
            from .tracking import finish_run

            finish_run(run_id)
    if not _is_main_process():
        return 0
    if run_id is not None:
        d["mlflow_run_id"] = run_id
    out.mkdir(parents=True, exist_ok=True)
    from .launch import RESULT_FILE

    # strict JSON, as summary.json: a NaN (nothing measured) in the summary, the log history or the eval records is
    # null, which jq and JavaScript read (a bare NaN they refuse); the readers here (sage launch, the flows, log_summary
    # and log_history through numeric_metrics) skip a null as they find no metric, which reads back as NaN
    (out / RESULT_FILE).write_text(json.dumps(strict_json(d), indent=2, default=repr, allow_nan=False))
    brief = {k: d.get(k) for k in ("output_dir", "global_step", "wall_seconds")}
    print("sage train: done " + json.dumps(brief), flush=True)
    summary = d.get("summary")
    if summary:  # as summary.json has it: a value not measured (NaN) is null, which strict JSON readers take
        print(json.dumps(strict_json(summary), indent=2, default=repr, allow_nan=False), flush=True)
    return 0


FULL_BELOW = 1 << 20  # bytes free under which a failed write is taken for a full disk


def _disk_full(out: Path, error: BaseException) -> str | None:
    """Why `error`, which ended a training writing into `out`, is the disk's doing, in words (None: it is not): an
    OSError of a full or read-only disk in its chain, or an OSError or RuntimeError (torch.save's, on a full disk:
    'unexpected pos 590144 vs 590036') raised while the disk holding `out` has under FULL_BELOW bytes free."""
    import errno

    seen, e = [], error
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return f"{e.strerror} ({e.filename or out})"
        e = e.__cause__ or e.__context__
    if not isinstance(error, (OSError, RuntimeError)):
        return None
    try:
        st = os.statvfs(out)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return f"the disk holding it is full ({free} bytes free)" if free < FULL_BELOW else None


def parse_benchmarks(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = (x.strip() for x in pair.partition("="))
        if not sep or not name or not path:
            raise SpecError(f"--benchmark expects name=path, got {pair!r}")
        if name in out:
            raise SpecError(f"--benchmark {name!r} given twice")
        out[name] = path
    return out


def check_eval_output(path: str | None) -> None:
    """Refuse an --output the table could not be written to, before the evaluation runs: not .parquet or .json, a
    folder, a folder that cannot be made for it, or one no file can be written in (read-only: the evaluation ran
    whole, then ended with the OSError's traceback and its table was not even printed)."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.suffix.lower() not in (".parquet", ".json"):
        raise SpecError(f"--output {path}: the table is written as .parquet or .json, not "
                        f"{p.suffix or 'a file without extension'}")
    if p.is_dir():
        raise SpecError(f"--output {path}: is a folder")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(f"--output {path}: its folder cannot be created ({e.strerror})") from None
    try:  # a file made and removed: root passes os.access on a folder of mode 555, a read-only mount does not
        fd, probe = tempfile.mkstemp(dir=p.parent, prefix=".sage-eval-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SpecError(f"--output {path}: no file can be written in {p.parent} ({e.strerror})") from None


def refuse_existing(label: str, path: Path, force: bool) -> None:
    """Refuse to write over a file already at `path` (an earlier table, a hints file) unless --force was given."""
    if path.exists() and not force:
        raise SpecError(f"{label}: exists; give another path, or --force to write it again")


def write_eval_output(table, path: str, replace: bool = True) -> Path:
    """The table written to `path` (.parquet or .json) through a file beside it, renamed over it once whole: a
    write that fails (a full disk) leaves the file that was there as it was. `replace` False (no --force): never
    over a file there by then, one another process made while the evaluation ran; the table goes to the first of
    FILE.new.EXT, FILE.new-2.EXT, ... (`path` FILE.EXT) that is free, each made exclusively too. Returns the path
    written."""
    out = dest = Path(path).expanduser()  # ~ as check_eval_output takes it (a .json went to a folder named ~)
    text = None if out.suffix.lower() == ".parquet" else json.dumps(_jsonable(table), indent=2)
    n = 0
    while True:
        try:
            if text is None:
                with atomic_path(dest, replace) as tmp:
                    table.to_parquet(tmp, index=False)
            else:
                write_text_atomic(dest, text, replace)
            return dest
        except FileExistsError:  # made there meanwhile (replace False only): the next free name beside it
            n += 1
            dest, replace = out.with_name(f"{out.stem}.new{f'-{n}' if n > 1 else ''}{out.suffix}"), False


HELDOUT_FIELDS = ("data", "data_split", "num_prompts", "seed", "difficulty")  # what a run's held-out set is cut by


def _as_trained(spec, args: argparse.Namespace):
    """A model a run here trained (its folder, final/ or a checkpoint-N/: the spec.json beside it): its prompts are
    built for the model it was trained from (the system turn, as the sage-eval flow does), and 'heldout' /
    'synthetic' are cut as its run cut them (its data, split, training rows and seed), unless --set or --spec give
    those fields."""
    from .spec import recorded_beside

    recorded = recorded_beside(args.model) or {}
    given = set(parse_sets(args.set)) | (set(load_spec_file(args.spec)) if args.spec else set())
    if (trained_from := recorded.get("model")) and trained_from != spec.model:
        print(f"sage eval: {args.model} was trained from {trained_from} (its run's spec.json): prompts are built "
              f"for it, not for the spec's model {spec.model}", file=sys.stderr)
        spec = spec.model_copy(update={"model": trained_from})
    update = {f: recorded[f] for f in HELDOUT_FIELDS if f in recorded and f not in given and recorded[f] != getattr(
        spec, f)}
    if update and set(parse_benchmarks(args.benchmark).values()) & {"heldout", "synthetic"}:
        print(f"sage eval: held-out rows as {args.model}'s run cut them (its spec.json): "
              + ", ".join(f"{f}={v!r}" for f, v in update.items()), file=sys.stderr)
    return spec.model_copy(update=update) if update else spec


def cmd_eval(args: argparse.Namespace) -> int:
    benchmarks = parse_benchmarks(args.benchmark)
    check_eval_output(args.output)
    spec = build_spec(args.preset, args.spec, args.set)
    updates: dict[str, Any] = {}
    for name, field in (("k", "eval_k"), ("num_prompts", "eval_num_prompts"), ("temperature", "eval_temperature"),
                        ("top_p", "eval_top_p")):
        if getattr(args, name) is not None:
            updates[field] = getattr(args, name)
    if updates:
        from pydantic import ValidationError

        from .spec import RunSpec

        try:
            spec = RunSpec(**{**spec.model_dump(), **updates})
        except ValidationError as e:
            raise SpecError(format_validation_error(e)) from None
    for name, path in benchmarks.items():
        # the path itself (a file name may hold a colon), else a dataset folder with its NAME:CONFIG configuration
        here = any(Path(p).expanduser().exists() for p in (path, path.rsplit(":", 1)[0]))
        if path not in ("synthetic", "heldout") and not here and not re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", path):
            raise SpecError(f"--benchmark {name}={path}: no such file (and not an HF dataset name)")
    spec = _as_trained(spec, args)
    if args.output:  # the table written over a data file it was scored on would lose that file
        out = Path(args.output).expanduser().resolve()
        inputs = {f"--benchmark {name}'s data file": p for name, p in benchmarks.items()
                  if p not in ("synthetic", "heldout")}
        if "heldout" in benchmarks.values():
            inputs["the data file (data=) its held-out rows come from"] = spec.data
        for what, p in inputs.items():
            if Path(p).expanduser().resolve() == out:
                raise SpecError(f"--output {args.output}: is {what}; write the table elsewhere")
        refuse_existing(f"--output {args.output}", out, args.force)  # an earlier table, before minutes of eval
    from .data import benchmark_rows
    from .evaluate import evaluate

    rows = {name: benchmark_rows(spec, path) for name, path in benchmarks.items()}

    def scores(model: str):
        return evaluate(model, rows, use_vllm=spec.use_vllm, k=spec.eval_k, temperature=spec.eval_temperature,
                        top_p=spec.eval_top_p, max_new_tokens=spec.max_completion_length, seed=spec.seed,
                        gguf_file=spec.gguf_file)

    if checkpoints := run_checkpoints(args.model):  # a run's folder: each checkpoint, a curve over steps
        table = checkpoint_curve(args.model, checkpoints, scores)
    else:
        table = scores(args.model)
    # printed first: a table that cannot be written (the disk filled meanwhile) is still shown
    print(table.to_string(index=False) if hasattr(table, "to_string") else json.dumps(_jsonable(table), indent=2),
          flush=True)
    if args.output:
        try:
            written = write_eval_output(table, args.output, replace=args.force)
        except OSError as e:
            print(f"sage eval: --output {args.output}: not written ({e.strerror or e}); the table is above"
                  + (", the file there is as it was" if Path(args.output).expanduser().exists() else ""),
                  file=sys.stderr)
            return 1
        if written != Path(args.output).expanduser():  # exit 1: a script must not read the other file as this table
            print(f"sage eval: --output {args.output}: a file was made there while the evaluation ran, not written "
                  f"over (--force would); the table is in {written}", file=sys.stderr)
            return 1
    return 0


def run_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint-N/ of a run's folder (one `sage train` wrote: a spec.json, no model of its
    own), in step order: `sage eval --model RUN` evaluates each, a curve after training (keep_checkpoints=None keeps
    them all). [] for anything else: a model folder, a name."""
    run = Path(folder).expanduser()
    if not (run / "spec.json").is_file() or (run / "config.json").exists():
        return []
    found = [(int(m.group(1)), str(p)) for p in run.glob("checkpoint-*")
             if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()]
    if not found:
        raise SpecError(f"--model {folder}: a run's folder without checkpoint-N/ folders to evaluate (its final/ is "
                        f"{run / 'final'})")
    return sorted(found)


def checkpoint_curve(folder: str, checkpoints: list[tuple[int, str]], scores) -> Any:
    """The scores of a run's checkpoints (`scores(path)`, a table each), with their step and path, one after
    another; a run may be training into the folder meanwhile, or have been stopped while saving. A checkpoint is
    skipped, with a line on stderr naming it and why, where it has no trainer_state.json (HF's Trainer writes it after
    the weights and the tokenizer: the checkpoint is being saved, or its save was cut short), where it is gone (the
    run's keep_checkpoints removed it since it was listed) or where its model does not load (a truncated weights
    file, no tokenizer: ModelNotFound). One of them failed the whole evaluation, the checkpoints scored before it
    lost, or scored a checkpoint without its tokenizer (an empty one: torch's traceback from generate). None left to
    score is a SpecError naming each."""
    import pandas as pd

    from .models import ModelNotFound

    tables, skipped = [], []
    for step, path in checkpoints:
        why = "no trainer_state.json: being saved, or its save was cut short"
        if (Path(path) / "trainer_state.json").is_file():
            try:
                tables.append(scores(path).assign(step=step, model=path))
                continue
            except ModelNotFound as e:
                why = str(e)
        if not Path(path).exists():
            why = "removed since it was listed: the run keeps its newest keep_checkpoints"
        skipped.append(path)
        print(f"sage eval: skipped {path} ({why})", file=sys.stderr)
    if not tables:
        raise SpecError(f"--model {folder}: none of its checkpoints could be evaluated (each skipped as said above: "
                        f"{', '.join(Path(p).name for p in skipped)})")
    return pd.concat(tables, ignore_index=True)


def cmd_hints(args: argparse.Namespace) -> int:
    """Write a teacher's hints for every training prompt of a spec to a hints file (prompt_id, level, hint and the
    problem_sha of the problem each was written for), to train with later (`--set hint_source=teacher --set
    teacher=FILE.jsonl`). The hints go to FILE.partial.jsonl chunk by chunk; a run that stops keeps them and the next
    run asks only for the rest (hints written for another problem under the same prompt id are asked again); the
    finished file is renamed to FILE.jsonl. Hints there that are not for this spec's problems (another spec's prompt
    ids, another problem under one id) are never dropped: they stay in FILE.partial.jsonl and go on into FILE.jsonl
    (one hints file holds hints for several problems, told apart by problem_sha); one without problem_sha under
    this spec's prompt ids is asked again and replaced (training would take it for this spec's problem). Where the
    teacher gave no answer for some hints (also a hint whose resample went unanswered after a leak), or every hint it
    wrote leaked the answer, FILE.jsonl is not written (one already there stays as it was), FILE.partial.jsonl keeps
    the others and the command exits 1; a chunk the teacher answered none of ends the asking (down or hung: each
    chunk more would wait on it). An endpoint is checked before the first request (up, serving the model, taking the
    API key). Each row names the teacher that wrote it (hints.teacher_label); a FILE.partial.jsonl another teacher
    began is not resumed where there is anything to ask (the two teachers' hints would be mixed in one file).
    Without --force, a FILE.jsonl someone made while the teacher was asked is not written over: it stays, the hints
    stay in FILE.partial.jsonl and the command exits 1."""
    spec = build_spec(args.preset, args.spec, args.set)
    teacher = args.teacher or spec.teacher
    if not teacher:
        raise SpecError("--teacher (or the spec's teacher): a local model path or an OpenAI-compatible URL "
                        "(http[s]://host/v1)")
    from .hints import is_hints_file
    from .spec import teacher_url_error

    if is_hints_file(teacher):
        raise SpecError(f"--teacher {teacher}: already a hints file; give the model that writes them")
    if why := teacher_url_error(teacher):  # the teacher's label goes into every row written
        raise SpecError(why)
    try:
        levels = sorted({int(x) for x in args.levels.split(",")})
    except ValueError:
        levels = []
    if not levels or any(lv not in (1, 2, 3) for lv in levels):
        raise SpecError(f"--levels {args.levels!r}: a comma-separated list of hint levels 1, 2, 3")
    out = Path(args.out)
    partial = out.with_name(out.stem + ".partial.jsonl")
    sources = {Path(p).expanduser().resolve(): what for what, p in (
        ("the training data (data=)", spec.data), ("the eval data (eval_data=)", spec.eval_data)) if p}
    for f in (out, partial):  # written over (--force, or chunk by chunk): never a data file the spec reads
        if what := sources.get(f.expanduser().resolve()):
            raise SpecError(f"--out {out}: {f} is {what}, which the hints would be written over; write them elsewhere")
    refuse_existing(f"--out {out}", out, args.force)
    if out.suffix.lower() != ".jsonl":
        raise SpecError(f"--out {out}: a hints file is written as JSON lines: name it .jsonl")
    if args.chunk < 1:
        raise SpecError(f"--chunk {args.chunk}: at least 1")
    from .data import _is_blank, build_dataset, read_records
    from .hints import (
        HintContext,
        HintRequest,
        TeacherHints,
        pick_hints,
        problem_sha,
        read_hint_variants,
        teacher_label,
        write_hints,
    )

    rows = build_dataset(spec)
    shas = {r["prompt_id"]: problem_sha(r["problem"]) for r in rows}
    teacher_model = args.teacher_model or spec.teacher_model
    me = teacher_label(teacher, teacher_model)
    records = read_records(str(partial), "hints")[0] if partial.exists() else []  # read once: it may be large
    variants = read_hint_variants(partial, records) if records else {}
    # who wrote each hint there (None: a file written before hints were labelled, or by hand)
    by = {(str(r["prompt_id"]), int(r["level"]), None if _is_blank(r.get("problem_sha")) else str(r["problem_sha"])):
          None if _is_blank(r.get("teacher")) else str(r["teacher"])
          for r in (records if variants else ())}
    done, redo = pick_hints({k: v for k, v in variants.items() if k[0] in shas}, shas, loose=False)
    redo = [k for k in redo if k[1] in levels]
    # every hint there for another problem (another spec's prompt ids, another problem_sha under this spec's ids):
    # the teacher wrote it, so it goes into every rewrite of the file and into --out, as it is. One without
    # problem_sha under this spec's ids, at a level asked for, is replaced: training would take it for this spec's
    # problem (one at a level not asked for is not this command's to replace, and stays as it is)
    kept = [(pid, lv, text, sha) for (pid, lv), by_sha in variants.items() for sha, text in by_sha.items()
            if pid not in shas or sha not in (None, shas[pid]) or sha is None and lv not in levels]
    other_ids = sum(pid not in shas for pid, *_ in kept)
    unmarked = sum(None in by_sha for (pid, lv), by_sha in variants.items() if pid in shas and lv in levels)
    reqs = [HintRequest(r["prompt_id"], r["problem"], r["solution"], r["answer"], lvl)
            for r in rows for lvl in levels if (r["prompt_id"], lvl) not in done]
    if reqs and (others := sorted({t for t in by.values() if t not in (None, me)})):  # nothing to ask: nothing mixed
        raise SpecError(f"--out {out}: {partial} holds hints written by another teacher ({', '.join(others)}), and "
                        f"this command's teacher is {me}: the two would be mixed in one file. Finish it with that "
                        f"teacher, or move {partial} away to start over")
    if done or kept or unmarked:
        print(f"resuming: {len(done)} hints already in {partial}"
              + (f"; {len(redo)} others there were not written for this spec's problems (their problem_sha differs "
                 "or is missing): asked again" + (f", {unmarked} without problem_sha replaced, the others kept "
                                                  "beside them" if unmarked else ", the old ones kept beside them")
                 if redo else "")
              + (f"; {other_ids} hints for prompt ids not in this spec: kept as they are" if other_ids else ""))

    def save() -> None:  # this spec's hints, each with its problem_sha, and every hint kept for other problems,
        # each with the teacher that wrote it
        write_hints(partial, [(pid, lv, text, shas[pid], by.get((pid, lv, shas[pid]), me))
                              for (pid, lv), text in done.items()]
                    + [(pid, lv, text, sha, by.get((pid, lv, sha))) for pid, lv, text, sha in kept])

    # checked (an endpoint asked) only where there is something to ask it
    source = TeacherHints(teacher, teacher_model, spec.hint_max_tokens) if reqs else None

    def no_policy(*_):
        raise AssertionError("the teacher writes every hint")

    ctx = HintContext(generate=no_policy, retries=spec.hint_retries, temperature=spec.hint_temperature)
    counts = {lv: {"written": sum(k[1] == lv for k in done), "leaked": 0, "failed": 0} for lv in levels}
    not_asked = 0  # hints left unasked after a chunk the teacher answered none of
    for start in range(0, len(reqs), args.chunk):
        chunk = reqs[start:start + args.chunk]
        results = source.get(chunk, ctx)
        for q, r in zip(chunk, results, strict=True):
            if r.text is not None:
                done[(q.prompt_id, q.level)] = r.text
            # a hint whose last request went unanswered failed, even where an earlier sample leaked: asked again
            counts[q.level]["written" if r.text is not None else "leaked" if r.leaked and not r.unanswered
                            else "failed"] += 1
        save()
        print(f"hints: {min(start + args.chunk, len(reqs))}/{len(reqs)} asked, {len(done)} for this spec in "
              f"{partial}" + (f" (and {len(kept)} others kept)" if kept else ""), flush=True)
        if all(r.unanswered for r in results):  # down or hung: each chunk more would wait on it again
            not_asked = len(reqs) - start - len(chunk)
            break
    print(f"{'level':>5} {'written':>8} {'leaked':>7} {'failed':>7}")
    for lv in levels:
        c = counts[lv]
        print(f"{lv:>5} {c['written']:>8} {c['leaked']:>7} {c['failed']:>7}")
    failed, leaked = (sum(c[k] for c in counts.values()) for k in ("failed", "leaked"))
    if failed:  # the teacher gave no answer: keep what was written, and --out (a good file with --force) as it was
        print(f"sage hints: {failed} of {len(reqs)} hints failed (the teacher gave no answer, or a request did not "
              "fit its context: the warnings above say which; the second needs a larger context or a lower "
              f"hint_max_tokens, not another try); {out} was not "
              f"written, the {len(done)} hints written" + (f" and the {len(kept)} for other problems" if kept else "")
              + f" are kept in {partial}: run the same command again to ask only for the hints not there "
              f"({failed} failed, {leaked} leaked)" + (f"; the teacher answered none of the last chunk's "
                                                       f"{len(chunk)} requests, so the other {not_asked} hints were "
                                                       "not asked for" if not_asked else ""), file=sys.stderr)
        return 1
    if leaked and leaked == len(reqs):  # a file with none of the hints asked for is no teacher's hints file
        print(f"sage hints: every one of the {len(reqs)} hints asked for leaked (the teacher wrote the answer into "
              f"each of its {1 + spec.hint_retries} samples; see the table above): {out} was not written"
              + (f", the {len(done)} hints written before are kept in {partial}" if done else "")
              + "; ask for lower --levels, or use another teacher", file=sys.stderr)
        return 1
    save()  # once more (also when nothing was asked), so every row of this spec carries its problem_sha
    try:
        if args.force:
            partial.replace(out)
        else:
            move_new(partial, out)
    except FileExistsError:  # exit 1, as sage eval: a script must not train on the other file as these hints
        print(f"sage hints: --out {out}: a file was made there while the hints were asked, not written over; the "
              f"{len(done) + len(kept)} hints are in {partial} (the same command with --force writes them to {out})",
              file=sys.stderr)
        return 1
    print(f"wrote {len(done)} hints for {len(rows)} prompts to {out}"
          + (f", with the {len(kept)} hints for other problems that {partial} held ({len(done) + len(kept)} in all)"
             if kept else "") + f"; train with --set hint_source=teacher --set teacher={out}")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from .presets import PRESETS, preset

    print(f"{'preset':<14} {'model':<32} {'method':<6} {'steps':>5} {'prompts x G':>11}  generation")
    for name in PRESETS:
        s = preset(name)
        gen = f"vllm-{s.vllm_mode}" if s.use_vllm else "transformers"
        print(f"{name:<14} {s.model:<32} {s.method:<6} {s.max_steps:>5} "
              f"{f'{s.prompts_per_step} x {s.num_generations}':>11}  {gen}")
    return 0


def cmd_spec(args: argparse.Namespace) -> int:
    spec = build_spec(args.preset, args.spec, args.set)
    print(spec.model_dump_json(indent=2))
    return 0


def _parse_gpus(value: str | None) -> list | None:
    """--gpus: a count takes the first N GPUs this process may use (CUDA_VISIBLE_DEVICES as a scheduler set it,
    which may name GPUs 4-7 or UUIDs; without it, GPUs 0..N-1, also to plan a launch elsewhere with --dry-run);
    ids (0,1,2, or 3, for one) are taken as given."""
    if value is None:
        return None
    value = value.strip()
    if not value.strip(", "):
        raise SpecError(f"--gpus {value!r}: blank; give a count (8) or ids (0,1,2), or leave --gpus out to use every "
                        "visible GPU")
    if value.isdigit() and "," not in value:
        from .launch import visible_gpus

        n = int(value)
        if n < 1:
            raise SpecError(f"--gpus {value}: no CUDA GPU in a count of 0 (for the GPU with id 0 write --gpus 0,)")
        if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
            return list(range(n))
        seen = visible_gpus()
        if n > len(seen):
            raise SpecError(f"--gpus {n}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} lets this "
                            f"process use {len(seen)} GPU(s)")
        return seen[:n]
    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"--gpus expects a count (8) or ids (0,1,2), got {value!r}") from None
    if negative := [i for i in ids if i < 0]:
        raise SpecError(f"--gpus {value}: GPU ids are 0 or more, got {', '.join(map(str, negative))}; give a count "
                        "(8) or ids (0,1,2)")
    if twice := sorted({i for i in ids if ids.count(i) > 1}):
        raise SpecError(f"--gpus {value}: GPU {', '.join(map(str, twice))} given more than once; each id once")
    return ids


def cmd_launch(args: argparse.Namespace) -> int:
    from . import launch as L
    from .spec import run_folder_lock

    spec = build_spec(args.preset, args.spec, args.set)
    if args.vllm_mode and not spec.use_vllm:  # else the layout is transformers' and the flag would do nothing
        raise SpecError(f"--vllm-mode {args.vllm_mode}: this spec generates with transformers (use_vllm is off); "
                        "add --set use_vllm=true, or leave --vllm-mode out")
    if args.port is not None and (not spec.use_vllm or (args.vllm_mode or spec.vllm_mode) != "server"):
        raise SpecError(f"--port {args.port} is the vllm serve port of server mode; this launch starts no server "
                        "(add --vllm-mode server with use_vllm, or leave --port out)")
    # a server URL given here (--set, not a --spec file an earlier launch wrote) is where this launch's server listens
    server_url = spec.vllm_server_base_url if "vllm_server_base_url" in parse_sets(args.set) else None
    kw = {"gpus": _parse_gpus(args.gpus), "config": args.config, "vllm_mode": args.vllm_mode,
          "server_gpus": args.server_gpus, "port": args.port, "server_gpu_mem": args.server_gpu_mem,
          "server_url": server_url}
    try:
        out = Path(args.output_dir).resolve() if args.output_dir else None
        p = L.plan(spec, out or Path.cwd(), **kw)  # layout errors before any MLflow run is opened
        if out is None:  # the spec's own folder, named after the layout's vllm_mode (not the server's URL)
            out = default_output_dir(spec.model_copy(update={"vllm_mode": p.spec.vllm_mode}))
            p = L.plan(spec, out, **kw)
        # the folder against the spec the ranks train and record (the layout's vllm_mode, its server's URL): the
        # same launch run again resumes there
        check_run_dir(p.spec, out)
        if args.dry_run:  # the spec file is written, so the printed commands run as they are (on other nodes too)
            p.write_spec()
            print(f"# layout: {p.layout.describe()}")
            print(f"# spec file: {p.spec_path}")
            print(p.shell())
            return 0
        # held for its ranks from before its MLflow run is opened: a second launch into a folder being trained was
        # refused only by its rank 0, after it had reopened the first launch's MLflow run, which it then ended FAILED
        with run_folder_lock(out):
            res = _launch_held(L, spec, p, out, args, kw)
    except (ValueError, FileNotFoundError) as e:  # FileNotFoundError: $SAGE_TRAIN_VENV lacks accelerate/vllm
        raise SpecError(str(e)) from None
    return res.returncode


def _launch_held(L, spec, p, out: Path, args: argparse.Namespace, kw: dict):
    """cmd_launch in its run folder, held (spec.run_folder_lock): its MLflow run, then the launch, whose ranks are
    told the folder is held for them (spec.HELD_ENV)."""
    from .spec import HELD_ENV

    run_id = None
    if args.mlflow:
        from . import tracking

        _forget_run_id(p.spec, out)
        run_id, _ = tracking.resume_or_create_run(p.spec, "train", out, experiment=args.experiment)
    with _sigterm_raises("launch"):  # stopped (Ctrl-C, SIGTERM): its run KILLED, its vLLM server stopped
        try:
            res = L.launch(spec, out, check=False, mlflow_run_id=run_id, env={**os.environ, HELD_ENV: str(out)},
                           **kw)
        except BaseException as e:
            _end_run(run_id, e)
            raise
    if run_id is not None:
        if res.ok and res.result:
            tracking.log_summary(res.result.get("summary") or {}, run_id=run_id)
        tracking.finish_run(run_id, status="FINISHED" if res.ok else "FAILED")
    return res


# ---------------------------------------------------------------------------------------------- parser
def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"named preset (see `sage presets`; default {DEFAULT_PRESET})")
    p.add_argument("--spec", metavar="FILE", help="JSON file of RunSpec fields (applied over the preset)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                   help="override one RunSpec field, e.g. --set method=grpo --set max_steps=4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sage", description="SAGE Studio: GRPO with self-hints from the "
                                     "reference solution, on TRL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train", help="train one RunSpec", description="Train one RunSpec (preset -> --spec -> "
                       "--set). Under `accelerate launch` every rank runs this command.")
    _add_spec_args(p)
    p.add_argument("--output-dir", help="run folder (default $SAGE_HOME/runs/<method>-<spec key>)")
    p.add_argument("--mlflow", action="store_true", help="log to MLflow (MLFLOW_TRACKING_URI or $SAGE_HOME)")
    p.add_argument("--experiment", help="MLflow experiment name (with --mlflow)")
    p.add_argument("--no-resume", action="store_true",
                   help="start over: delete what an earlier run left in the output dir (checkpoint-*, final/, "
                   "adapter/, tracker files, fixed hints) and, with --mlflow, open a new MLflow run")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="no-hint avg@k / pass@k of a model on benchmarks",
                       description="No-hint avg@k / pass@k. Sampling settings (eval_k, eval_temperature, "
                       "eval_top_p, max_completion_length, use_vllm) come from the spec; its model decides the "
                       "system turn (none for tiny-cpu, the paper's prompt for the GPU presets), except for a run's "
                       "final/ or checkpoint-N/: the model its run was trained from (the spec.json beside it).")
    p.add_argument("--model", required=True, help="model path (a run's final/ or checkpoint-N/ folder), 'tiny', an HF "
                   "id, or a run's folder: each of its checkpoint-N/ (a `step` column)")
    p.add_argument("--benchmark", action="append", required=True, metavar="NAME=PATH",
                   help="benchmark name and .parquet/.jsonl file or data set, 'synthetic' (held-out synthetic rows) "
                        "or 'heldout' (the held-out rows of the spec's data); repeatable")
    _add_spec_args(p)
    p.add_argument("--k", type=int, help="samples per prompt (spec eval_k)")
    p.add_argument("--num-prompts", type=int, help="prompts per benchmark (spec eval_num_prompts)")
    p.add_argument("--temperature", type=float, help="sampling temperature (spec eval_temperature)")
    p.add_argument("--top-p", type=float, help="nucleus p (spec eval_top_p)")
    p.add_argument("--output", help="write the table to this .parquet or .json file (not one that exists: --force)")
    p.add_argument("--force", action="store_true", help="write --output again where it exists")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("hints", help="write a teacher's hints for a spec's training prompts to a hints file",
                       description=cmd_hints.__doc__)
    _add_spec_args(p)
    p.add_argument("--teacher", help="a local model path or an OpenAI-compatible URL (default: the spec's teacher)")
    p.add_argument("--teacher-model", help="the served model's name, for a URL (default: the spec's teacher_model)")
    p.add_argument("--levels", default="1,2,3", help="hint levels to write (default 1,2,3)")
    p.add_argument("--out", required=True, help="the hints file to write (.jsonl)")
    p.add_argument("--chunk", type=int, default=256, help="requests between two saves of FILE.partial.jsonl")
    p.add_argument("--force", action="store_true", help="write --out again where it exists")
    p.set_defaults(func=cmd_hints)

    p = sub.add_parser("presets", help="list the named presets")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("spec", help="print a validated RunSpec as JSON")
    _add_spec_args(p)
    p.set_defaults(func=cmd_spec)

    p = sub.add_parser("launch", help="run a spec on GPUs with accelerate launch (+ vllm serve in server mode)")
    _add_spec_args(p)
    p.add_argument("--output-dir", help="run folder (default $SAGE_HOME/runs/<method>-<spec key>)")
    p.add_argument("--gpus", help="GPU count (8) or ids (0,1,2,3); default: all visible")
    p.add_argument("--config", choices=["zero3", "fsdp", "multi_gpu", "single_gpu"],
                   help="accelerate config (default single_gpu for 1 process, zero3 otherwise)")
    p.add_argument("--vllm-mode", choices=["colocate", "server"], help="override the spec's vllm_mode")
    p.add_argument("--server-gpus", type=int, default=1, help="GPUs for vllm serve (tensor parallel), server mode")
    p.add_argument("--port", type=int, help="vllm serve port, server mode (default: the port of a --set "
                   "vllm_server_base_url, else 8000)")
    p.add_argument("--server-gpu-mem", type=float, default=0.9, help="vllm serve --gpu-memory-utilization")
    p.add_argument("--mlflow", action="store_true", help="open an MLflow run here; the ranks log into it")
    p.add_argument("--experiment", help="MLflow experiment name (with --mlflow)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.set_defaults(func=cmd_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "experiment", None) and not args.mlflow:  # it was ignored: the run went unlogged, unnoticed
        print(f"sage {args.command}: --experiment {args.experiment} names an MLflow experiment: add --mlflow to log "
              "the run there", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `sage launch --dry-run | head`: the reader is gone, nothing left to tell it
        if not _stdout_gone():  # a socket's or a child's pipe: a failure to show whole, as any other
            raise
        # (Python's advice: point stdout at devnull so that its flush at exit does not raise again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (SpecError, DataError, ModelNotFound, TeacherError, LoraTargetsNotFound) as e:
        # bad input: the message says what, no traceback
        print(f"sage {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ImportError, FileNotFoundError) as e:
        if not _says_what_is_missing(e):
            raise
        print(f"sage {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C: what was saved stays (a run resumes from its last checkpoint), no traceback
        print(f"sage {args.command}: stopped (Ctrl-C)", file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
    except Exception as e:
        tracking = sys.modules.get(f"{__package__}.tracking")  # raised only once imported: not imported for this
        if tracking is None or not isinstance(e, tracking.TrackingError):
            raise
        # the MLflow store refused a run's results (locked past the retries): the message says where they are kept
        print(f"sage {args.command}: {e}", file=sys.stderr, flush=True)
        return 1


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader is gone (`sage spec | head -1`), where a BrokenPipeError is the end of
    the output, not a failure: one raised by a socket (a teacher, a vLLM server) or a child's pipe is a failure to
    show, and taken for the reader's it ended the command with status 1 and no word. Its output left to write fails
    again, and poll() sees the pipe's error (POLLERR; a socket's POLLHUP); stdout that is no file (a caller's
    StringIO) is none."""
    try:
        fd = sys.stdout.fileno()
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: no file; ValueError: closed
        return False
    if not hasattr(select, "poll"):  # Windows
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def _says_what_is_missing(e: ImportError | FileNotFoundError) -> bool:
    """An ImportError or FileNotFoundError raised with a message that says what to install (use_vllm without vLLM,
    a $SAGE_TRAIN_VENV without a python): it names no module and has no errno, unlike one from a failed import or
    open deep in the code, which is a bug to show whole."""
    return (e.name if isinstance(e, ImportError) else e.errno) is None


if __name__ == "__main__":
    sys.exit(main())
