"""The `sage` command line: spec building and validation messages, presets, launch dry-run, lazy imports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sage_core import cli
from sage_core.presets import PRESETS
from sage_core.spec import RunSpec
from sage_core.train import strict_json

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_is_fast_and_imports_nothing_heavy():
    code = ("import sys; from sage_core import cli; cli.build_parser().format_help(); "
            "heavy = [m for m in ('torch', 'trl', 'transformers', 'mlflow', 'prefect', 'datasets') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    r = subprocess.run([sys.executable, "-m", "sage_core.cli", "--help"], capture_output=True, text=True, cwd=ROOT,
                       check=False)
    assert r.returncode == 0 and "train" in r.stdout and "launch" in r.stdout


def test_presets_lists_every_preset(capsys):
    rc, out, _ = run_cli(capsys, "presets")
    assert rc == 0
    for name in PRESETS:
        assert name in out
    assert "vllm-colocate" in out and "transformers" in out


def test_spec_layers_preset_file_and_sets(capsys, tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"method": "grpo", "max_steps": 7, "num_generations": 4}))
    rc, out, _ = run_cli(capsys, "spec", "--preset", "tiny-cpu", "--spec", str(f), "--set", "max_steps=3",
                         "--set", "learning_rate=1e-6", "--set", "bf16=false", "--set", "max_prompt_length=none",
                         "--set", "use-vllm=true")
    assert rc == 0
    d = json.loads(out)
    assert d["method"] == "grpo" and d["num_generations"] == 4  # from the file
    assert d["max_steps"] == 3 and d["learning_rate"] == 1e-6 and d["bf16"] is False  # --set wins
    assert d["max_prompt_length"] is None and d["use_vllm"] is True
    assert d["max_completion_length"] == PRESETS["tiny-cpu"]["max_completion_length"]  # from the preset


def test_set_none_is_a_value_where_the_field_takes_no_none(capsys, tmp_path):
    """`none` is None for a field that can be None, and the value itself for one that cannot: weighting's default
    choice is the string 'none', which --set can put back over a spec file."""
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"weighting": "log", "rollout_budget": 64}))
    rc, out, err = run_cli(capsys, "spec", "--spec", str(f), "--set", "weighting=none", "--set", "rollout_budget=none")
    assert rc == 0, err
    d = json.loads(out)
    assert d["weighting"] == "none" and d["rollout_budget"] is None
    rc, _, err = run_cli(capsys, "spec", "--set", "max_steps=none")  # an int field: refused by its own check
    assert rc == 2 and "max_steps" in err


def test_set_values_are_read_without_the_spaces_around_them(capsys):
    """The key was stripped and the value not: `lookahead= false` was refused and `teacher_model= m ` kept its
    spaces (a model name the endpoint would not know)."""
    rc, out, err = run_cli(capsys, "spec", "--set", "lookahead= false", "--set", " teacher_model = m ",
                           "--set", "max_steps =3")
    assert rc == 0, err
    d = json.loads(out)
    assert d["lookahead"] is False and d["teacher_model"] == "m" and d["max_steps"] == 3


def test_spec_defaults_to_tiny_cpu(capsys):
    rc, out, _ = run_cli(capsys, "spec")
    assert rc == 0 and json.loads(out)["max_steps"] == PRESETS["tiny-cpu"]["max_steps"]


@pytest.mark.parametrize("argv, needle", [
    (["--set", "max_steps=0"], "max_steps: Input should be greater than or equal to 1 (got '0')"),
    (["--set", "learning_rate=fast"], "learning_rate: Input should be a valid number"),
    (["--set", "method=ppo"], "method: Input should be 'grpo'"),
    (["--set", "light_min=0.9"], "light_min (0.9) must be <= light_max"),
    (["--set", "max_stepz=3"], "unknown RunSpec field 'max_stepz'"),
    (["--set", "max_steps"], "--set expects key=value"),
    (["--preset", "tiny-gpu"], "unknown preset 'tiny-gpu' (did you mean tiny-cpu"),
    (["--spec", "/nonexistent/spec.json"], "no such file"),
    (["--set", "data="], "data: String should have at least 1 character (got '')"),
    (["--set", "eval_temperature=-1"], "eval_temperature: Input should be greater than or equal to 0"),
    (["--set", "eval_top_p=1.5"], "eval_top_p: Input should be less than or equal to 1"),
    (["--set", "micro_batch_size=3"], "micro_batch_size (3) must divide prompts_per_step x num_generations (8 x 8"),
    (["--set", "updates_per_generation=2"], "updates_per_generation (2) must divide 1 (no micro_batch_size"),
    (["--set", "micro_batch_size=16", "--set", "updates_per_generation=3"],
     "updates_per_generation (3) must divide the 4 micro-batches of a step"),
])
def test_invalid_specs_exit_2_naming_the_field(capsys, argv, needle):
    rc, out, err = run_cli(capsys, "spec", *argv)
    assert rc == 2 and out == ""
    assert needle in err, err
    assert err.startswith("sage spec: ")


def test_experiment_without_mlflow_is_refused(capsys, tmp_path):
    """--experiment names an MLflow experiment: without --mlflow it was ignored, and the run went unlogged with no word
    said. It is refused before anything runs (no run folder made)."""
    for cmd in ("train", "launch"):
        rc, out, err = run_cli(capsys, cmd, "--preset", "tiny-cpu", "--output-dir", str(tmp_path / cmd),
                               "--experiment", "mine")
        assert rc == 2 and out == ""
        assert err == f"sage {cmd}: --experiment mine names an MLflow experiment: add --mlflow to log the run there\n"
        assert not (tmp_path / cmd).exists()


def test_output_to_a_closed_pipe_ends_quietly(tmp_path):
    """`sage spec | head -1` and the like: a reader gone before the output is written ends the command with status
    1 and no traceback (it printed BrokenPipeError's, twice: the flush at exit raised again)."""
    p = subprocess.Popen([sys.executable, "-m", "sage_core.cli", "spec", "--preset", "tiny-cpu"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the command writes
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1, err
    assert err == ""


def test_a_broken_pipe_not_of_stdout_is_a_failure_shown_whole():
    """A BrokenPipeError of a socket (a teacher, a vLLM server gone) or of a child's pipe, stdout being read still, is a
    failure like any other: its traceback is shown, and what the command printed stays (it was taken for the reader
    gone: status 1, no word said, and stdout pointed at devnull)."""
    code = ("import socket, sys\n"
            "from sage_core import cli\n"
            "def spec(args):\n"
            "    print('written before', flush=True)\n"
            "    a, b = socket.socketpair()\n"
            "    b.close()\n"
            "    a.sendall(b'x' * 100_000)\n"
            "cli.cmd_spec = spec\n"
            "sys.exit(cli.main(['spec']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and r.stdout == "written before\n"
    assert "in spec\nBrokenPipeError: " in r.stderr, r.stderr


def test_spec_file_errors(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, _, err = run_cli(capsys, "spec", "--spec", str(bad))
    assert rc == 2 and "not valid JSON" in err
    bad.write_text(json.dumps({"num_generation": 4}))
    rc, _, err = run_cli(capsys, "spec", "--spec", str(bad))
    assert rc == 2 and "num_generation: Extra inputs are not permitted" in err
    bad.write_text("[1, 2]")
    rc, _, err = run_cli(capsys, "spec", "--spec", str(bad))
    assert rc == 2 and "JSON object" in err
    bad.write_bytes(b'\xff\xfe{"max_steps": 1}')
    rc, _, err = run_cli(capsys, "spec", "--spec", str(bad))
    assert rc == 2 and "is not UTF-8 text" in err and "Traceback" not in err


def test_train_that_cannot_start_exits_2_before_importing_train(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sage_core.train", None)  # importing it would raise
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "num_prompts=4", "--output-dir",
                         str(tmp_path / "run"))
    assert rc == 2 and "num_prompts (4) is fewer than prompts_per_step (8)" in err
    assert not (tmp_path / "run").exists()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--output-dir", str(a_file))
    assert rc == 2 and err.startswith(f"sage train: --output-dir {a_file}: exists and is not a folder")
    assert a_file.read_text() == "mine"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_into_the_folder_of_another_spec_exits_2_and_keeps_its_files(capsys, tmp_path, tiny_model_dir):
    """A run folder holds one spec's run: another method, data or --no-resume with another spec is refused and
    every file of the first run stays as it was; a longer max_steps continues it."""
    out = tmp_path / "run"
    small = ["--preset", "tiny-cpu", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--set",
             "num_generations=2", "--set", "max_completion_length=8", "--set", "max_steps=1"]
    rc, _, err = run_cli(capsys, "train", *small, "--output-dir", str(out))
    assert rc == 0, err
    before = _tree(out)
    for other in (["--set", "method=grpo"], ["--set", "method=grpo", "--no-resume"], ["--set", "data=rows.jsonl"]):
        rc, _, err = run_cli(capsys, "train", *small, *other, "--output-dir", str(out))
        assert rc == 2 and err.startswith(f"sage train: --output-dir {out} holds a run of another spec (")
        assert ("method 'sage' -> 'grpo'" if "method=grpo" in other else "data 'synthetic' -> 'rows.jsonl'") in err
        assert _tree(out) == before
    # train() itself refuses too (the flows and library callers do not go through the CLI)
    from sage_core.spec import RunFolderTaken
    from sage_core.train import train

    spec = json.loads((out / "spec.json").read_text())
    for resume in (True, False):
        with pytest.raises(RunFolderTaken, match=r"holds a run of another spec \(method 'sage' -> 'grpo'\)"):
            train(RunSpec(**{**spec, "method": "grpo"}), out, resume=resume)
        assert _tree(out) == before
    rc, _, err = run_cli(capsys, "train", *small, "--set", "max_steps=2", "--output-dir", str(out))
    assert rc == 0, err
    assert json.loads((out / "train_result.json").read_text())["global_step"] == 2
    assert (out / "checkpoint-1").is_dir() and (out / "tracker" / "step_000002.parquet").is_file()


@pytest.mark.parametrize(("world", "want"), [
    ("3", "prompts_per_step x num_generations = 2 x 4 = 8 rows a step do not split over 3 processes"),
    ("4", "each of 4 processes rolls out 2 rows a step, not a multiple of num_generations (4)"),
])
def test_a_batch_that_does_not_split_over_the_processes_exits_2(capsys, tmp_path, monkeypatch, world, want):
    """Known only once the processes are started (each rank sees WORLD_SIZE): a one-line error, exit 2, on every
    rank, before the model is loaded."""
    monkeypatch.setenv("WORLD_SIZE", world)
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "prompts_per_step=2", "--set",
                         "num_generations=4", "--output-dir", str(tmp_path / "run"))
    assert rc == 2 and err.strip() == f"sage train: {want}" + (
        ": every prompt's group must live on one process; use a prompts_per_step that is a multiple of the "
        "process count" if world == "4" else ""), err


@pytest.mark.parametrize("mlflow", [[], ["--mlflow"]])
def test_a_folder_where_a_run_failed_to_start_takes_another_spec(capsys, tmp_path, monkeypatch, mlflow):
    """A run that failed before its first step leaves only its spec.json (and with --mlflow its MLflow run id):
    nothing to keep, so another spec may use the folder (it gets past the folder check to its own error), in an
    MLflow run of its own; the same spec again reopens its run."""
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    out = tmp_path / "run"
    run_ids = []
    for i in (1, 2, 2):
        bad = tmp_path / f"rows{i}.jsonl"
        bad.write_text('{"problem": "p"}\n')
        rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", f"data={bad}", "--output-dir", str(out),
                             *mlflow)
        assert rc == 2 and f"\nsage train: {bad}: missing column 'answer'" in "\n" + err, err  # after MLflow's logs
        assert json.loads((out / "spec.json").read_text())["data"] == str(bad)
        run_ids.append((out / "mlflow_run_id").read_text().strip() if mlflow else None)
    if mlflow:
        from sage_core import tracking

        assert run_ids[0] != run_ids[1] == run_ids[2]
        assert tracking.client().get_run(run_ids[0]).data.params["sage.data"] == str(tmp_path / "rows1.jsonl")
        assert tracking.client().get_run(run_ids[1]).data.params["sage.data"] == str(tmp_path / "rows2.jsonl")


def test_train_validation_error_exits_before_importing_train(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sage_core.train", None)  # importing it would raise
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "num_generations=1")
    assert rc == 2 and "num_generations: Input should be greater than or equal to 2" in err


def test_train_with_bad_data_exits_2_naming_the_file_and_line(capsys, tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"problem": "p", "answer": "1"}\n{"problem": "q"\n')
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", f"data={bad}", "--output-dir",
                         str(tmp_path / "out"))
    assert rc == 2 and err.startswith(f"sage train: {bad}: line 2 is not valid JSON") and "Traceback" not in err
    assert not (tmp_path / "out" / "train_result.json").exists()


def test_train_with_every_prompt_over_max_prompt_length_exits_2(capsys, tmp_path, tiny_model_dir):
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "max_prompt_length=3", "--output-dir",
                         str(tmp_path / "out"))
    assert rc == 2 and "prompts fit max_prompt_length=3 tokens" in err and "Traceback" not in err
    assert (tmp_path / "out" / "dropped_prompts.json").exists()  # which ones, and how long


def test_eval_of_a_missing_model_folder_exits_2_naming_it(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "final"), "--benchmark", "s=synthetic")
    assert rc == 2 and err.startswith(f"sage eval: model not found: {tmp_path / 'final'} does not exist")


needs_no_vllm = pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None,
                                   reason="vLLM is installed here")


@needs_no_vllm
def test_use_vllm_without_vllm_exits_2_saying_what_to_install(capsys, tmp_path, monkeypatch):
    """use_vllm where vLLM is missing (eval, eval through a $SAGE_TRAIN_VENV that is not there, train on CPU) is a
    setup to mend: one line on stderr, exit code 2, no traceback."""
    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)
    argv = ["eval", "--model", "tiny", "--benchmark", "s=synthetic", "--num-prompts", "2", "--set", "use_vllm=true"]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err.startswith("sage eval: use_vllm=True needs vLLM") and len(err.splitlines()) == 1
    monkeypatch.setenv("SAGE_TRAIN_VENV", str(tmp_path / "nonexistent"))
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err == f"sage eval: SAGE_TRAIN_VENV={tmp_path / 'nonexistent'}: no " \
        f"{tmp_path / 'nonexistent' / 'bin' / 'python'} (a venv with vLLM, e.g. make gpu-venv)\n"
    import torch

    if not torch.cuda.is_available():
        monkeypatch.delenv("SAGE_TRAIN_VENV")
        rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "use_vllm=true", "--output-dir",
                             str(tmp_path / "run"))
        assert rc == 2 and err.startswith("sage train: use_vllm on a machine without CUDA needs vLLM's CPU build")


def test_an_import_or_open_that_fails_in_the_code_is_not_hidden(monkeypatch):
    """Only the errors that say what to install are shown as one line: a failed import or open is a bug, with its
    traceback."""
    def broken_import(args):
        import sage_core.no_such_module  # noqa: F401

    def broken_open(args):
        open("/nonexistent/sage-file")  # noqa: SIM115

    for broken, error in ((broken_import, ModuleNotFoundError), (broken_open, FileNotFoundError)):
        monkeypatch.setattr(cli, "cmd_presets", broken)
        with pytest.raises(error):
            cli.main(["presets"])


def test_eval_of_a_folder_that_is_no_model_exits_2_naming_it(capsys, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    rc, _, err = run_cli(capsys, "eval", "--model", str(folder), "--benchmark", "s=synthetic")
    assert rc == 2 and err.startswith(f"sage eval: model folder {folder} has no config.json: not a saved model")
    table = tmp_path / "rows.csv"  # e.g. a teacher hints file of the wrong type, taken for a model
    table.write_text("prompt_id,level,hint\n")
    rc, _, err = run_cli(capsys, "eval", "--model", str(table), "--benchmark", "s=synthetic")
    assert rc == 2 and err.startswith(f"sage eval: model file {table} has no config.json: not a saved model")


def test_eval_output_that_is_an_input_data_file_is_refused_before_anything_runs(capsys, tmp_path):
    """`--output` naming a benchmark's file (or the spec's data file) would replace the data with the score table."""
    import pandas as pd

    data = tmp_path / "data.parquet"
    pd.DataFrame({"problem": ["1 + 1 ?"], "answer": ["2"]}).to_parquet(data)
    before = data.read_bytes()
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", f"mine={data}", "--output", str(data))
    assert rc == 2 and err.startswith(f"sage eval: --output {data}: is --benchmark mine's data file"), err
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "s=heldout", "--set", f"data={data}",
                         "--output", str(tmp_path / ".." / tmp_path.name / "data.parquet"))
    assert rc == 2 and "is the data file (data=) its held-out rows come from" in err, err
    assert data.read_bytes() == before


def test_eval_of_a_runs_checkpoint_builds_prompts_for_the_model_it_was_trained_from(capsys, tmp_path, monkeypatch):
    """A run trained from a real model saw the paper's system turn; `sage eval --model run/final` under the default
    (tiny) spec evaluates it with that turn too (the spec.json beside final/ says which model), as the flow does."""
    import pandas as pd

    from sage_core import evaluate as ev
    from sage_core.prompts import SYSTEM_PROMPT

    seen = {}

    def fake_evaluate(model, rows, **kw):
        seen.update(rows)
        return pd.DataFrame([{"benchmark": "s", "k": 1, "avg_at_k": 0.0, "pass_at_k": 0.0, "n_prompts": 1}])

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "spec.json").write_text(RunSpec(model="org/real").model_dump_json())
    rc, _, err = run_cli(capsys, "eval", "--model", str(run / "final"), "--benchmark", "s=synthetic", "--k", "1")
    assert rc == 0 and "was trained from org/real" in err
    assert all(r["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT} for r in seen["s"])
    (run / "spec.json").write_text(RunSpec(model="tiny").model_dump_json())  # the tiny model: no system turn
    rc, _, err = run_cli(capsys, "eval", "--model", str(run / "final"), "--benchmark", "s=synthetic", "--k", "1")
    assert rc == 0 and "trained from" not in err and all(r["prompt"][0]["role"] == "user" for r in seen["s"])


def test_train_of_a_model_without_a_chat_template_exits_2_saying_so(capsys, tmp_path, tiny_model_dir):
    """A base model's tokenizer has no chat template: refused before training (TRL failed mid-step, a traceback)."""
    import shutil

    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", f"model={model}", "--set", "max_steps=1",
                         "--output-dir", str(tmp_path / "run"))
    last = err.strip().splitlines()[-1]  # (after transformers' weight-loading progress bar)
    assert rc == 2 and last.startswith(f"sage train: model {model}: its tokenizer has no chat template"), err
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def _model_with_template(tiny_model_dir, folder, refuse: str):
    """A copy of the tiny model whose chat template raises, as real ones do, where `refuse` ('system' or 'no-system')
    says: Gemma's refuses a system turn, some templates ask for one."""
    import shutil

    shutil.copytree(tiny_model_dir, folder)
    template = (folder / "chat_template.jinja").read_text()
    test = "==" if refuse == "system" else "!="
    message = "System role not supported" if refuse == "system" else "This model needs a system turn first"
    (folder / "chat_template.jinja").write_text(
        f"{{%- if messages[0]['role'] {test} 'system' -%}}{{{{ raise_exception('{message}') }}}}{{%- endif -%}}"
        + template)
    return folder


def test_train_with_a_template_refusing_sages_turns_exits_2_before_training(capsys, tmp_path, tiny_model_dir):
    """A chat template that refuses a system turn fails every training prompt (a model other than 'tiny' gets the
    paper's system turn); one that asks for a system turn fails SAGE's hint requests (a user turn alone), at the
    first collapsed group, mid-step, with jinja's traceback. Both are refused before training, naming the model, the
    prompt and the template's message; GRPO (no hint requests) trains with the second."""
    needs = _model_with_template(tiny_model_dir, tmp_path / "needs-system", "no-system")
    refuses = _model_with_template(tiny_model_dir, tmp_path / "no-system", "system")
    small = ["--set", "num_prompts=4", "--set", "prompts_per_step=2", "--set", "num_generations=2", "--set",
             "max_completion_length=4", "--set", "max_steps=1"]
    rc, _, err = run_cli(capsys, "train", "--set", f"model={needs}", "--set", "method=sage", *small,
                         "--output-dir", str(tmp_path / "run1"))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"sage train: model {needs}: its chat template refuses a hint request"), err
    assert "(turns: user): This model needs a system turn first" in last
    assert not (tmp_path / "run1" / "checkpoint-1").exists()
    rc, _, err = run_cli(capsys, "train", "--set", f"model={refuses}", "--set", "method=grpo", *small,
                         "--output-dir", str(tmp_path / "run2"))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "its chat template refuses a training prompt (turns: system, user): System role" in last, err
    rc, _, err = run_cli(capsys, "train", "--set", f"model={needs}", "--set", "method=grpo", *small,
                         "--output-dir", str(tmp_path / "run3"))
    assert rc == 0 and (tmp_path / "run3" / "checkpoint-1").exists(), err


def test_eval_and_hints_with_a_template_refusing_their_turns_exit_2(capsys, tmp_path, tiny_model_dir):
    """`sage eval` under the tiny-cpu spec sends a user turn alone, as `sage hints` asks a local teacher: a template
    asking for a system turn failed with jinja's traceback once generating began; it is one line naming both."""
    needs = _model_with_template(tiny_model_dir, tmp_path / "needs-system", "no-system")
    rc, _, err = run_cli(capsys, "eval", "--model", str(needs), "--benchmark", "s=synthetic", "--k", "1",
                         "--num-prompts", "2")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"sage eval: model {needs}: its chat template refuses the prompts of "
                                       "benchmark 's' (turns: user): This model needs a system turn first"), err
    rc, _, err = run_cli(capsys, "hints", "--teacher", str(needs), "--out", str(tmp_path / "hints.jsonl"), "--set",
                         "num_prompts=2")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and f"teacher: model {needs}: its chat template refuses a hint request (turns: user)" in last, err


def test_train_of_a_model_whose_context_is_too_short_exits_2_saying_so(capsys, tmp_path, tiny_model_dir):
    """A model whose context (max_position_embeddings) is shorter than the longest prompt + hint + completion: HF
    generate failed mid-step on learned positions (IndexError) and went on silently on rotary ones (the tiny model's,
    as here); refused before training, naming the model, its context, the prompt and the lengths."""
    import shutil

    model = tmp_path / "short"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    small = ["--preset", "tiny-cpu", "--set", f"model={model}", "--set", "num_prompts=4", "--set",
             "prompts_per_step=2", "--set", "num_generations=2", "--set", "max_steps=1"]
    rc, _, err = run_cli(capsys, "train", *small, "--set", "method=sage", "--set", "max_completion_length=8",
                         "--output-dir", str(tmp_path / "run1"))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"sage train: model {model}: its context is 64 tokens"), err
    assert "+ a hint of up to" in last and "max_completion_length=8 = " in last
    assert not (tmp_path / "run1" / "checkpoint-1").exists()
    rc, _, err = run_cli(capsys, "train", *small, "--set", "method=grpo", "--set", "max_completion_length=64",
                         "--output-dir", str(tmp_path / "run2"))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "its context is 64 tokens" in last and "hint" not in last.split(";")[0], err
    # a max_prompt_length the context has room for spares counting the prompts; one it has none for does not
    rc, _, err = run_cli(capsys, "train", *small, "--set", "method=grpo", "--set", "max_completion_length=64",
                         "--set", "max_prompt_length=1000", "--output-dir", str(tmp_path / "run4"))
    assert rc == 2 and "its context is 64 tokens" in err.strip().splitlines()[-1], err
    rc, _, err = run_cli(capsys, "train", *small, "--set", "method=grpo", "--set", "max_completion_length=4",
                         "--output-dir", str(tmp_path / "run3"))
    assert rc == 0 and (tmp_path / "run3" / "checkpoint-1").exists(), err


def test_lora_target_modules_the_model_lacks_exit_2_naming_them(capsys, tmp_path, tiny_model_dir):
    """A typo in lora_target_modules: refused with a one-line message naming it and the model's linear layers, not
    peft's NoMatchingPeftModuleError traceback once the trainer is built."""
    rc, _, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "lora_r=4", "--set",
                         "lora_target_modules=q_proj,qproj", "--set", "max_steps=1", "--output-dir",
                         str(tmp_path / "run"))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("sage train: lora_target_modules 'q_proj,qproj': 'qproj' names no module"), err
    assert "q_proj" in last.split("its linear layers are", 1)[1]
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_train_calls_train_and_writes_result(capsys, tmp_path, monkeypatch):
    """`sage train` hands the built spec, the output dir and resume to sage_core.train.train and writes
    train_result.json (the file sage_core.launch reads back)."""
    import types
    from dataclasses import dataclass, field

    calls = {}

    @dataclass
    class FakeResult:
        output_dir: Path
        checkpoint_dir: Path
        tracker_dir: Path
        global_step: int
        wall_seconds: float
        summary: dict = field(default_factory=dict)
        eval: object = None

    def fake_train(spec, output_dir, callbacks=(), resume=True):
        calls.update(spec=spec, output_dir=output_dir, callbacks=callbacks, resume=resume)
        return FakeResult(output_dir, output_dir / "checkpoint", output_dir / "tracker", spec.max_steps, 1.5,
                          {"reward": 0.25})

    fake = types.SimpleNamespace(train=fake_train, shutdown_distributed=lambda: calls.update(shutdown=True),
                                 LayoutError=type("LayoutError", (ValueError,), {}), strict_json=strict_json)
    monkeypatch.setitem(sys.modules, "sage_core.train", fake)
    rc, out, _ = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "max_steps=2", "--set", "method=grpo",
                         "--output-dir", str(tmp_path / "run"), "--no-resume")
    assert rc == 0
    assert calls["spec"].max_steps == 2 and calls["spec"].method == "grpo"
    assert calls["output_dir"] == (tmp_path / "run").resolve() and calls["resume"] is False
    assert calls["callbacks"] == [] and calls["shutdown"]  # a multi-process run ends its process group
    saved = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert saved["global_step"] == 2 and saved["summary"] == {"reward": 0.25}
    assert saved["checkpoint_dir"].endswith("checkpoint")
    assert '"global_step": 2' in out


def test_train_prints_the_summary_as_summary_json_has_it(capsys, tmp_path, monkeypatch):
    """What `sage train` prints after `done` is the summary as summary.json holds it: a value not measured (NaN, e.g.
    eval_avg_at_k without eval_every) is null, not a bare NaN that jq and other strict JSON readers refuse; so is
    train_result.json, NaNs of the log history and the eval records included."""
    import types

    import pandas as pd

    def fake_train(spec, output_dir, callbacks=(), resume=True):
        return {"output_dir": str(output_dir), "global_step": 1,
                "summary": {"reward": 0.5, "eval_avg_at_k": float("nan"), "activation_mb": float("inf")},
                "log_history": [{"step": 1, "loss": float("nan"), "reward": 0.5}],
                "eval": pd.DataFrame({"benchmark": ["a", "b"], "avg_at_k": [0.25, float("nan")]})}

    monkeypatch.setitem(sys.modules, "sage_core.train", types.SimpleNamespace(
        train=fake_train, shutdown_distributed=lambda: None, LayoutError=type("LayoutError", (ValueError,), {}),
        strict_json=strict_json))
    rc, out, _ = run_cli(capsys, "train", "--set", "max_steps=1", "--output-dir", str(tmp_path / "run"))
    assert rc == 0
    printed = out.split("sage train: done ", 1)[1].split("\n", 1)[1]

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    assert json.loads(printed, parse_constant=refuse) == {"reward": 0.5, "eval_avg_at_k": None, "activation_mb": None}
    saved = json.loads((tmp_path / "run" / "train_result.json").read_text(), parse_constant=refuse)
    assert saved["summary"] == {"reward": 0.5, "eval_avg_at_k": None, "activation_mb": None}
    assert saved["log_history"] == [{"step": 1, "loss": None, "reward": 0.5}]
    assert saved["eval"] == [{"benchmark": "a", "avg_at_k": 0.25}, {"benchmark": "b", "avg_at_k": None}]


def _fake_train(monkeypatch) -> dict:
    """sage_core.train replaced by one that records the spec it is given and trains nothing."""
    import types

    calls: dict = {}

    def fake_train(spec, output_dir, callbacks=(), resume=True):
        calls.update(spec=spec, output_dir=output_dir, resume=resume)
        return {"output_dir": str(output_dir), "global_step": spec.max_steps, "summary": {"reward": 0.5}}

    monkeypatch.setitem(sys.modules, "sage_core.train", types.SimpleNamespace(
        train=fake_train, shutdown_distributed=lambda: None, LayoutError=type("LayoutError", (ValueError,), {}),
        strict_json=strict_json))
    return calls


def test_train_no_resume_with_mlflow_opens_a_new_run(capsys, tmp_path, monkeypatch):
    """--no-resume starts the run over, in a new MLflow run (not the one `<output_dir>/mlflow_run_id` names, which
    would get every step logged twice); without it the recorded run is reopened."""
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    _fake_train(monkeypatch)
    out = tmp_path / "run"
    argv = ["train", "--set", "max_steps=2", "--output-dir", str(out), "--mlflow", "--experiment", "cli-fresh"]
    ids = []
    for more in ([], ["--no-resume"], []):
        rc, stdout, err = run_cli(capsys, *argv, *more)
        assert rc == 0, err
        ids.append(json.loads((out / "train_result.json").read_text())["mlflow_run_id"])
        assert ("(resumed)" in stdout) == (len(ids) == 3)
    assert ids[0] != ids[1] == ids[2] == (out / "mlflow_run_id").read_text().strip()
    # --no-resume without --mlflow starts over too: the next --mlflow opens a new run, not the one that logged the
    # trajectory started over
    rc, _, err = run_cli(capsys, *argv[:-3], "--no-resume")
    assert rc == 0 and not (out / "mlflow_run_id").exists(), err
    rc, stdout, err = run_cli(capsys, *argv)
    assert rc == 0 and "(resumed)" not in stdout, err
    assert json.loads((out / "train_result.json").read_text())["mlflow_run_id"] not in ids


@pytest.mark.parametrize("release_after", [0.5, None])
def test_train_whose_store_is_locked_as_it_ends_waits_or_keeps_the_summary(capfd, tmp_path, monkeypatch,
                                                                           release_after):
    """`sage train --mlflow` logs the summary and ends its run once trained: a sqlite store another writer held
    then failed the command with MLflow's traceback, the summary lost. Both are tried again a few times: a lock gone
    meanwhile takes them; one that outlasts the tries is one line saying where the summary is kept, exit 1, and the
    same command again (it trains nothing more) logs it and finishes the run."""
    import contextlib

    from helpers import store_held

    from sage_core import tracking

    home = tmp_path / "home"
    monkeypatch.setenv("SAGE_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "1.5")
    calls = _fake_train(monkeypatch)
    out = tmp_path / "run"
    argv = ["train", "--set", "max_steps=2", "--output-dir", str(out), "--mlflow"]
    with contextlib.ExitStack() as held:
        real = sys.modules["sage_core.train"].train
        sys.modules["sage_core.train"].train = lambda *a, **k: (real(*a, **k), held.enter_context(
            store_held(home, release_after)))[0]  # trained: the store is taken as the command logs the end
        rc, _, err = run_cli(capfd, *argv)  # MLflow's traceback is printed by its logger: the fd's
    sys.modules["sage_core.train"].train = real
    assert calls and "Traceback" not in err and "SQL" not in err, err
    rid = (out / "mlflow_run_id").read_text().strip()
    run = tracking.client().get_run(rid)
    unlogged = home / tracking.UNLOGGED_DIR / rid
    if release_after is not None:
        assert rc == 0 and run.info.status == "FINISHED" and run.data.metrics["summary/reward"] == 0.5, err
        assert not unlogged.exists()
        return
    assert rc == 1 and run.info.status == "RUNNING" and "summary/reward" not in run.data.metrics
    [kept] = unlogged.iterdir()
    locked = rf"MLflow run {rid}: the store {re.escape(tracking.shown_uri())} stayed locked through 5 tries in \d+ s "
    assert re.search(rf"^sage: MLflow run {rid} could not be ended \(TrackingError: {locked}\(MlflowException: "
                     r"\(sqlite3.OperationalError\) database is locked\): its end \(FAILED\) is not logged; the "
                     r"run is left as it was: the same command run again reopens and ends it\)\n"
                     rf"sage train: {locked}.*: its summary is not logged; it is kept in {re.escape(str(kept))}, "
                     r"and the same training run again \(it trains nothing more\) logs it\n\Z", err, re.M), err
    assert json.loads(kept.read_text())["metrics"] == {"summary/reward": 0.5}
    rc, _, err = run_cli(capfd, *argv)
    run = tracking.client().get_run(rid)
    assert rc == 0 and run.info.status == "FINISHED" and run.data.metrics["summary/reward"] == 0.5, err


def test_train_whose_store_is_locked_as_its_run_opens_waits_or_exits_1_before_training(capfd, tmp_path, monkeypatch):
    """`sage train --mlflow` opens its run before training: a sqlite store another writer held then failed the
    command with MLflow's traceback. Opening is tried again: a lock that outlasts the tries is one line naming the
    store, exit 1, nothing trained and no run made; a lock gone meanwhile opens the run and the command trains."""
    from helpers import store_held

    from sage_core import tracking

    home = tmp_path / "home"
    monkeypatch.setenv("SAGE_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "0.3")
    calls = _fake_train(monkeypatch)
    out = tmp_path / "run"
    argv = ["train", "--set", "max_steps=2", "--output-dir", str(out), "--mlflow"]
    tracking.get_or_create_experiment()  # the store, made before it is held
    with store_held(home):
        rc, _, err = run_cli(capfd, *argv)
    assert rc == 1 and not calls and "Traceback" not in err, err
    assert re.fullmatch(
        rf"sage train: MLflow run \(new, experiment 'sage'\): the store {re.escape(tracking.shown_uri())} stayed "
        r"locked through 5 tries in \d+ s \(MlflowException: \(sqlite3.OperationalError\) database is locked\): its "
        r"creation is not logged; nothing is trained yet: run the same command again once the store is free",
        err.splitlines()[-1]), err
    assert tracking.find_runs() == [] and not (out / "mlflow_run_id").exists()
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "3")
    with store_held(home, release_after=1):
        rc, _, err = run_cli(capfd, *argv)
    assert rc == 0 and calls, err
    (run,) = tracking.find_runs()
    assert (out / "mlflow_run_id").read_text().strip() == run.info.run_id and run.info.status == "FINISHED"


def test_train_into_a_folder_another_process_trains_in_exits_2_and_touches_nothing(capsys, tmp_path, monkeypatch):
    """Two `sage train` into one output dir at once both trained the same steps into its checkpoints and tracker
    files, each in an MLflow run of its own (mlflow_run_id named one of them). The second is refused, naming the
    folder and the process training there, before it opens an MLflow run or starts over (--no-resume deletes);
    once that process is gone (any way it ends: the kernel drops its lock) the folder trains again."""
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    calls = _fake_train(monkeypatch)
    out = tmp_path / "run"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "spec.json").write_text(cli.build_spec(cli.DEFAULT_PRESET, None, ["max_steps=2"]).model_dump_json())
    (out / "mlflow_run_id").write_text("the-other-run\n")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from sage_core.spec import run_folder_lock\n"
                               f"with run_folder_lock({str(out)!r}):\n print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, _, err = run_cli(capsys, "train", "--set", "max_steps=2", "--output-dir", str(out), "--mlflow",
                             "--no-resume")
    finally:
        holder.communicate("")
    assert rc == 2 and not calls, err
    assert f"--output-dir {out} is being trained by another process (pid {holder.pid})" in err, err
    assert (out / "checkpoint-1").is_dir() and (out / "mlflow_run_id").read_text() == "the-other-run\n"
    assert not (tmp_path / "home").exists()  # no MLflow store was opened
    rc, _, err = run_cli(capsys, "train", "--set", "max_steps=2", "--output-dir", str(out))
    assert rc == 0 and calls["output_dir"] == out, err


def test_train_whose_store_refused_its_last_logs_exits_1_saying_where_they_are(capsys, tmp_path, monkeypatch):
    """A model trained and saved whose MLflow store refused the last logs (sqlite 'database is locked') ended with
    MLflow's chained tracebacks, and the store refused ending the run too (a second traceback in the handler): the
    command says what is kept where (tracking.TrackingError) and exits 1."""
    from sage_core import tracking

    def fake_train(spec, output_dir, callbacks=(), resume=True):
        raise tracking.TrackingError("MLflow run r: the store refused the run's last logs; kept in X")

    monkeypatch.setitem(sys.modules, "sage_core.train", __import__("types").SimpleNamespace(
        train=fake_train, shutdown_distributed=lambda: None, LayoutError=type("LayoutError", (ValueError,), {}),
        strict_json=strict_json))
    monkeypatch.setattr(cli, "_open_tracking", lambda *a: ([], "r"))
    monkeypatch.setattr(tracking, "finish_run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("locked")))
    rc, _, err = run_cli(capsys, "train", "--set", "max_steps=2", "--output-dir", str(tmp_path / "run"))
    assert rc == 1 and "Traceback" not in err
    assert err.splitlines() == ["sage: MLflow run r could not be ended (RuntimeError: locked)",
                                "sage train: MLflow run r: the store refused the run's last logs; kept in X"]


@pytest.mark.parametrize("error,free,needle", [
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 590144 vs 590036"), 0,
     "the disk holding it is full (0 bytes free) (RuntimeError: [enforce fail"),
    (OSError(28, "No space left on device", "/x/tracker/step_000003.parquet.tmp"), 1 << 30,
     "No space left on device (/x/tracker/step_000003.parquet.tmp) (OSError: "),
    (RuntimeError("a bug"), 0, "the disk holding it is full"),
    (RuntimeError("a bug"), 1 << 30, None)])
def test_train_ended_by_a_full_disk_exits_1_naming_the_folder(capsys, tmp_path, monkeypatch, error, free, needle):
    """A disk that filled while a checkpoint was saved ended `sage train` with torch's traceback ('unexpected pos
    590144 vs 590036', reproduced on a 20 MB tmpfs), naming neither the disk nor the folder; it says both, and that
    the checkpoints saved before stay. Another error, with room on the disk, is a bug: raised whole."""
    import types

    def fake_train(spec, output_dir, callbacks=(), resume=True):
        raise error

    monkeypatch.setitem(sys.modules, "sage_core.train", types.SimpleNamespace(
        train=fake_train, shutdown_distributed=lambda: None, LayoutError=type("LayoutError", (ValueError,), {}),
        strict_json=strict_json))
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: types.SimpleNamespace(f_bavail=free, f_frsize=1)
                        if str(p).startswith(str(tmp_path)) else real(p))
    argv = ["train", "--set", "max_steps=2", "--output-dir", str(tmp_path / "run")]
    if needle is None:
        with pytest.raises(RuntimeError, match="a bug"):
            cli.main(argv)
        return
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 1 and "Traceback" not in err
    assert err.startswith(f"sage train: writing to {tmp_path / 'run'} failed: {needle}"), err
    assert "what was saved before stays: make room, then run the same command again" in err


def test_every_command_starts_from_the_tiny_cpu_preset(capsys, tmp_path, monkeypatch):
    """Without --preset, `sage train` trains the spec `sage spec` shows (the tiny-cpu preset's), in its folder;
    every command defaults to that preset and says so in its --help."""
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    calls = _fake_train(monkeypatch)
    rc, out, _ = run_cli(capsys, "spec")
    shown = RunSpec(**json.loads(out))
    assert rc == 0 and shown.max_steps == PRESETS["tiny-cpu"]["max_steps"]
    rc, _, err = run_cli(capsys, "train")
    assert rc == 0, err
    assert calls["spec"] == shown and calls["output_dir"] == cli.default_output_dir(shown)
    parser = cli.build_parser()
    for command in ("train", "eval", "hints", "spec", "launch"):
        sub = parser._subparsers._group_actions[0].choices[command]
        assert sub.get_default("preset") == "tiny-cpu"
        assert "default tiny-cpu" in " ".join(sub.format_help().split())


def test_default_output_dir_is_keyed_by_spec(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGE_HOME", str(tmp_path))
    a = cli.build_spec("tiny-cpu", None, ["method=grpo"])
    b = cli.build_spec("tiny-cpu", None, ["method=grpo"])
    c = cli.build_spec("tiny-cpu", None, ["method=sage"])
    assert cli.default_output_dir(a) == cli.default_output_dir(b) == tmp_path / "runs" / f"grpo-{a.key()}"
    assert cli.default_output_dir(c) != cli.default_output_dir(a)


def test_eval_argument_errors(capsys):
    rc, _, err = run_cli(capsys, "eval", "--model", "m", "--benchmark", "nopath")
    assert rc == 2 and "name=path" in err
    rc, _, err = run_cli(capsys, "eval", "--model", "m", "--benchmark", "a=x", "--benchmark", "a=y")
    assert rc == 2 and "given twice" in err
    rc, _, err = run_cli(capsys, "eval", "--model", "m", "--benchmark", "gsm=a.jsonl", "--benchmark", "gsm =b.jsonl")
    assert rc == 2 and "--benchmark 'gsm' given twice" in err  # the same name once spaces are stripped
    rc, _, err = run_cli(capsys, "eval", "--model", "m", "--benchmark", "a=x", "--k", "0")
    assert rc == 2 and "eval_k: Input should be greater than or equal to 1" in err
    with pytest.raises(SystemExit):
        cli.main(["eval", "--benchmark", "a=x"])  # --model is required (argparse exits 2)


@pytest.mark.parametrize("name, needle", [("table.csv", "written as .parquet or .json, not .csv"),
                                          ("folder", "written as .parquet or .json, not a file without extension"),
                                          ("folder.json", "is a folder"),
                                          ("notes.txt/eval.json", "its folder cannot be created")])
def test_eval_output_that_cannot_be_written_exits_2_before_evaluating(capsys, tmp_path, monkeypatch, name, needle):
    monkeypatch.setitem(sys.modules, "sage_core.evaluate", None)  # evaluating would raise
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder.json").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "s=synthetic", "--output",
                         str(tmp_path / name))
    assert rc == 2 and err.startswith(f"sage eval: --output {tmp_path / name}: ") and needle in err, err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_launch_dry_run_prints_commands(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)
    rc, out, _ = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "8", "--vllm-mode", "server",
                         "--set", "prompts_per_step=112", "--output-dir", str(tmp_path), "--dry-run")
    assert rc == 0
    lines = [s for s in out.splitlines() if not s.startswith("#")]
    # `vllm`, or a path to it: $SAGE_TRAIN_VENV's, this interpreter's venv's or PATH's (sage_core.launch._venv_script)
    assert re.match(r"CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 (\S*/)?vllm serve Qwen/Qwen2\.5-7B-Instruct ",
                    lines[0]), lines[0]
    assert lines[1].startswith("CUDA_VISIBLE_DEVICES=1,2,3,4,5,6,7 ")
    assert "--num_processes 7 --mixed_precision bf16 -m sage_core.cli train --spec" in lines[1]
    # the spec file the printed commands read is written (and nothing else), so they run as printed: on several
    # nodes too (docs/gpu.md, "Several nodes")
    spec_file = re.search(r"--spec (\S+)", lines[1]).group(1)
    assert spec_file == str(tmp_path / "launch_spec.json") and sorted(p.name for p in tmp_path.iterdir()) == [
        "launch_spec.json"]
    written = json.loads((tmp_path / "launch_spec.json").read_text())
    assert written["vllm_mode"] == "server" and written["prompts_per_step"] == 112 and written["vllm_server_base_url"]
    rc, out, _ = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "0,1,2,3,4,5,6,7", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert rc == 0 and "zero3.yaml --num_processes 8" in out and "vllm serve" not in out


def test_launch_run_again_resumes_in_its_folder(capsys, tmp_path, monkeypatch):
    """The same `sage launch --vllm-mode server` run again passes the folder check: the ranks record the spec they
    train (vllm_mode server, the server's URL), and the check compares the launch's spec, not the preset's."""
    from sage_core import launch as L
    from sage_core.presets import preset

    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)
    args = ("launch", "--preset", "qwen2.5-7b", "--gpus", "0,1", "--vllm-mode", "server", "--dry-run",
            "--output-dir", str(tmp_path))
    recorded = L.plan(preset("qwen2.5-7b"), tmp_path, gpus=[0, 1], vllm_mode="server").spec
    assert recorded.vllm_mode == "server" and recorded.vllm_server_base_url
    (tmp_path / "spec.json").write_text(recorded.model_dump_json())  # what the ranks' train() writes
    (tmp_path / "checkpoint-50").mkdir()
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0 and "vllm serve" in out, err
    rc, _, err = run_cli(capsys, *args[:5], "--output-dir", str(tmp_path), "--dry-run")  # colocate: another spec
    assert rc == 2 and "vllm_mode 'server' -> 'colocate'" in err
    # without --output-dir each layout has a folder of its own: a server launch is not sent to the colocate run's
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    folders = []
    for mode in ("colocate", "server"):
        rc, out, err = run_cli(capsys, *args[:5], "--vllm-mode", mode, "--dry-run")
        assert rc == 0, err
        folders.append(re.search(r"--output-dir (\S+)", out).group(1))
    assert folders[0] != folders[1] and all(f.startswith(str(tmp_path / "home" / "runs")) for f in folders)


def test_launch_gpu_count_takes_the_gpus_the_scheduler_gave(capsys, tmp_path, monkeypatch):
    """SLURM and containers set CUDA_VISIBLE_DEVICES: --gpus 2 means the first 2 of those, not GPUs 0 and 1."""
    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    rc, out, _ = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "2", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert rc == 0 and "CUDA_VISIBLE_DEVICES=4,5 " in out
    rc, _, err = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "6", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert rc == 2 and "CUDA_VISIBLE_DEVICES=4,5,6,7 lets this process use 4 GPU(s)" in err


def test_launch_layout_errors_exit_2(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "1", "--vllm-mode", "server",
                         "--dry-run", "--output-dir", str(tmp_path))
    assert rc == 2 and "at least 2 GPUs" in err
    rc, _, err = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "0", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert rc == 2 and "no CUDA GPU" in err
    rc, _, err = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "0,1,0,1,2", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert rc == 2 and "--gpus 0,1,0,1,2: GPU 0, 1 given more than once" in err
    # server-mode flags on a spec that generates with transformers (tiny-cpu) would do nothing: refused
    rc, _, err = run_cli(capsys, "launch", "--preset", "tiny-cpu", "--gpus", "2", "--vllm-mode", "server",
                         "--dry-run", "--output-dir", str(tmp_path))
    assert rc == 2 and "--vllm-mode server: this spec generates with transformers (use_vllm is off)" in err
    rc, _, err = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", "--gpus", "2", "--port", "8001", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert rc == 2 and "--port 8001 is the vllm serve port of server mode; this launch starts no server" in err


def test_train_tiny_end_to_end_with_mlflow(capsys, tmp_path, tiny_model_dir, monkeypatch):
    """A real 2-step SAGE run on the offline tiny model through `sage train --mlflow`: the checkpoint, the
    result file and a finished MLflow run with metrics."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "--preset", "tiny-cpu", "--set", "max_steps=2", "--set",
                              "num_prompts=8", "--set", "prompts_per_step=2", "--set", "num_generations=4",
                              "--set", "max_completion_length=24", "--output-dir", str(out), "--mlflow",
                              "--experiment", "cli-test")
    assert rc == 0, err
    res = json.loads((out / "train_result.json").read_text())
    assert res["global_step"] == 2 and Path(res["checkpoint_dir"]).is_dir()
    assert res["summary"]["rollouts"] >= 2 * 4 * 2
    assert [h["step"] for h in res["log_history"] if "step_time" in h] == [1, 2]
    from sage_core import tracking

    run = tracking.client().get_run(res["mlflow_run_id"])
    assert run.info.status == "FINISHED" and tracking.is_complete(run)
    assert run.data.params["sage.max_steps"] == "2"
    assert "sage/frac_collapsed" in run.data.metrics and "summary/rollouts" in run.data.metrics
    assert "MLflow run" in stdout


def test_eval_output_in_a_read_only_folder_exits_2_before_evaluating(capsys, tmp_path, monkeypatch):
    """An --output in a folder no file can be written in (a read-only mount: EROFS, even for root) ran the whole
    evaluation, then ended with the OSError's traceback, its table not even printed."""
    import errno

    monkeypatch.setitem(sys.modules, "sage_core.evaluate", None)  # evaluating would raise
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open = os.open

    def read_only(path, *args, **kwargs):  # what a read-only mount answers (root passes a folder of mode 555)
        if Path(path).parent == ro:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "s=synthetic", "--output",
                         str(ro / "t.json"))
    assert rc == 2 and err == (f"sage eval: --output {ro / 't.json'}: no file can be written in {ro} (Read-only file "
                               "system)\n"), err


def test_eval_output_that_fails_to_be_written_keeps_the_file_there_and_shows_the_table(capsys, tmp_path,
                                                                                        monkeypatch):
    """A table whose write fails once the evaluation ran (the disk filled meanwhile: ENOSPC) cut the file already
    at --output short (an earlier table: the write truncated it first), ended with the traceback and printed no
    table. The table is printed first and written beside the file, renamed over it once whole: the earlier file
    stays as it was, the command says so and exits 1, and nothing is left beside it."""
    import errno
    import types

    import pandas as pd

    def fake_evaluate(model_ref, benchmarks, **kw):
        return pd.DataFrame([{"benchmark": n, "k": kw["k"], "avg_at_k": 0.5, "pass_at_k": 1.0, "n_prompts": 3}
                             for n in benchmarks])

    def disk_full(self, path, **kwargs):
        Path(path).write_bytes(b"PAR1")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setitem(sys.modules, "sage_core.evaluate", types.SimpleNamespace(evaluate=fake_evaluate))
    out = tmp_path / "eval.parquet"
    argv = ["eval", "--model", "tiny", "--benchmark", "s=synthetic", "--k", "2", "--output", str(out)]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err
    earlier = out.read_bytes()
    monkeypatch.setattr(pd.DataFrame, "to_parquet", disk_full)
    rc, stdout, err = run_cli(capsys, *argv, "--force")
    assert rc == 1 and err == (f"sage eval: --output {out}: not written (No space left on device); the table is "
                               "above, the file there is as it was\n"), err
    assert "avg_at_k" in stdout and "0.5" in stdout
    assert out.read_bytes() == earlier and sorted(p.name for p in tmp_path.iterdir()) == ["eval.parquet"]


@pytest.mark.parametrize("name", ["eval.parquet", "eval.json"])
def test_eval_output_that_exists_is_refused_before_evaluating_unless_force(capsys, tmp_path, monkeypatch, name):
    """An --output already there (an earlier table) was written over without a word once the evaluation ended. It
    is refused before anything loads or evaluates (a model that does not exist gets this error, not its own), the
    file as it was, as `sage hints --out` refuses one; --force writes the new table over it."""
    import types

    import pandas as pd

    out = tmp_path / name
    out.write_bytes(b"an earlier table")
    monkeypatch.setitem(sys.modules, "sage_core.evaluate", None)  # evaluating would raise
    for model in ("tiny", str(tmp_path / "no-such-model")):
        rc, stdout, err = run_cli(capsys, "eval", "--model", model, "--benchmark", "s=synthetic", "--output", str(out))
        assert rc == 2 and err == f"sage eval: --output {out}: exists; give another path, or --force to write it " \
                                  "again\n", err
        assert stdout == "" and out.read_bytes() == b"an earlier table"

    def fake_evaluate(model_ref, benchmarks, **kw):
        return pd.DataFrame([{"benchmark": n, "k": kw["k"], "avg_at_k": 0.5, "pass_at_k": 1.0, "n_prompts": 3}
                             for n in benchmarks])

    monkeypatch.setitem(sys.modules, "sage_core.evaluate", types.SimpleNamespace(evaluate=fake_evaluate))
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "s=synthetic", "--k", "2", "--output",
                         str(out), "--force")
    assert rc == 0, err
    table = pd.read_parquet(out) if name.endswith(".parquet") else pd.DataFrame(json.loads(out.read_text()))
    assert table.to_dict("records") == [{"benchmark": "s", "k": 2, "avg_at_k": 0.5, "pass_at_k": 1.0, "n_prompts": 3}]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing left beside it



@pytest.mark.parametrize("name", ["eval.parquet", "eval.json"])
def test_eval_output_made_by_another_process_while_evaluating_is_kept(capsys, tmp_path, monkeypatch, name):
    """A file made at --output by someone else while the evaluation ran (minutes) was written over by the table at
    the end, lost. Without --force it stays as it was: the table goes to the first free FILE.new.EXT,
    FILE.new-2.EXT (FILE.new.EXT is there: never written over either), one line on stderr says where, and the
    command exits 1 (a script must not read the other file as this table). --force writes over it, as before."""
    import types

    import pandas as pd

    out = tmp_path / name
    stem, ext = name.split(".")
    (tmp_path / f"{stem}.new.{ext}").write_bytes(b"a table kept from before")

    def fake_evaluate(model_ref, benchmarks, **kw):
        out.write_bytes(b"another process's table")  # made while this one evaluates
        return pd.DataFrame([{"benchmark": n, "k": kw["k"], "avg_at_k": 0.5, "pass_at_k": 1.0, "n_prompts": 3}
                             for n in benchmarks])

    def read(path):
        return (pd.read_parquet(path) if ext == "parquet" else pd.DataFrame(json.loads(path.read_text())))

    monkeypatch.setitem(sys.modules, "sage_core.evaluate", types.SimpleNamespace(evaluate=fake_evaluate))
    argv = ["eval", "--model", "tiny", "--benchmark", "s=synthetic", "--k", "2", "--output", str(out)]
    rc, stdout, err = run_cli(capsys, *argv)
    kept = tmp_path / f"{stem}.new-2.{ext}"
    assert rc == 1 and err == (f"sage eval: --output {out}: a file was made there while the evaluation ran, not "
                               f"written over (--force would); the table is in {kept}\n"), err
    assert "avg_at_k" in stdout
    assert out.read_bytes() == b"another process's table"
    assert (tmp_path / f"{stem}.new.{ext}").read_bytes() == b"a table kept from before"
    table = [{"benchmark": "s", "k": 2, "avg_at_k": 0.5, "pass_at_k": 1.0, "n_prompts": 3}]
    assert read(kept).to_dict("records") == table
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, f"{stem}.new.{ext}", kept.name])
    out.unlink()
    rc, _, err = run_cli(capsys, *argv, "--force")
    assert rc == 0 and err == "", err
    assert read(out).to_dict("records") == table

def test_eval_hands_spec_settings_to_evaluate(capsys, tmp_path, monkeypatch):
    """`sage eval` loads each benchmark's rows (held-out synthetic rows, or a file cut to eval_num_prompts) and
    passes the spec's sampling settings to sage_core.evaluate.evaluate."""
    import types

    import pandas as pd

    calls = {}

    def fake_evaluate(model_ref, benchmarks, **kw):
        calls.update(model=model_ref, benchmarks={k: len(v) for k, v in benchmarks.items()}, **kw)
        return pd.DataFrame([{"benchmark": n, "k": kw["k"], "avg_at_k": 0.5, "pass_at_k": 1.0, "n_prompts": 3}
                             for n in benchmarks])

    monkeypatch.setitem(sys.modules, "sage_core.evaluate", types.SimpleNamespace(evaluate=fake_evaluate))
    from sage_core.data import synthetic_rows

    jl = tmp_path / "b.jsonl"
    jl.write_text("\n".join(json.dumps({"problem": r["problem"], "answer": r["answer"]})
                            for r in synthetic_rows(10, seed=3)))
    rc, out, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "syn=synthetic", "--benchmark",
                           f"file={jl}", "--k", "2", "--num-prompts", "3", "--temperature", "0.7",
                           "--output", str(tmp_path / "eval.parquet"))
    assert rc == 0, err
    assert calls["model"] == "tiny" and calls["benchmarks"] == {"syn": 3, "file": 3}
    assert calls["k"] == 2 and calls["temperature"] == 0.7 and calls["use_vllm"] is False
    assert calls["max_new_tokens"] == PRESETS["tiny-cpu"]["max_completion_length"]
    assert list(pd.read_parquet(tmp_path / "eval.parquet")["benchmark"]) == ["syn", "file"]
    assert "avg_at_k" in out
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "x=/no/such.parquet")
    assert rc == 2 and "no such file" in err
    # an HF name with its config is taken as one (offline here: it does not load, and the error says so)
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "gsm=openai/gsm8k:main")
    assert rc == 2 and "no such file" not in err and "openai/gsm8k:main: no such local file or folder" in err, err


def test_eval_takes_a_benchmark_file_with_a_colon_in_its_name_or_under_home(capsys, tmp_path, monkeypatch):
    """A benchmark file whose name holds a colon (a time stamp) or that is given under ~ is there: the data loader
    reads both, and `sage eval` must not refuse them as neither a file nor an HF dataset name. An --output under ~
    goes there too, .json as .parquet."""
    import types

    import pandas as pd

    seen = {}

    def fake_evaluate(model_ref, benchmarks, **kw):
        seen.update({k: len(v) for k, v in benchmarks.items()})
        return pd.DataFrame([{"benchmark": n, "k": kw["k"], "avg_at_k": 0.5, "pass_at_k": 1.0, "n_prompts": len(v)}
                             for n, v in benchmarks.items()])

    monkeypatch.setitem(sys.modules, "sage_core.evaluate", types.SimpleNamespace(evaluate=fake_evaluate))
    monkeypatch.setenv("HOME", str(tmp_path))
    from sage_core.data import synthetic_rows

    text = "\n".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) for r in synthetic_rows(4, seed=3))
    (tmp_path / "eval-12:30.jsonl").write_text(text)
    (tmp_path / "colon").mkdir()
    (tmp_path / "home.jsonl").write_text(text)
    rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", f"colon={tmp_path / 'eval-12:30.jsonl'}",
                         "--benchmark", "home=~/home.jsonl", "--k", "1")
    assert rc == 0, err
    assert seen == {"colon": 4, "home": 4}
    monkeypatch.chdir(tmp_path / "colon")  # --output under ~ is written there, not into a folder named ~ here
    for out in ("~/eval.json", "~/eval.parquet"):
        rc, _, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "home=~/home.jsonl", "--output", out)
        assert rc == 0, err
        assert (tmp_path / out[2:]).is_file() and not (tmp_path / "colon" / "~").exists()


def test_eval_tiny_for_real(capsys, tmp_path, tiny_model_dir):
    """`sage eval` on the offline tiny model with the real sage_core.evaluate (HF generate, 3 prompts, k=2)."""
    import pandas as pd

    out = tmp_path / "eval.parquet"
    rc, stdout, err = run_cli(capsys, "eval", "--model", "tiny", "--benchmark", "syn=synthetic", "--k", "2",
                              "--num-prompts", "3", "--output", str(out))
    assert rc == 0, err
    df = pd.read_parquet(out)
    assert list(df.columns) == ["benchmark", "k", "avg_at_k", "pass_at_k", "n_prompts"]
    row = df.iloc[0]
    assert row["benchmark"] == "syn" and row["k"] == 2 and row["n_prompts"] == 3
    assert 0.0 <= row["avg_at_k"] <= row["pass_at_k"] <= 1.0
    assert "avg_at_k" in stdout


def test_a_bad_teacher_exits_2_naming_it_before_the_policy_loads(capsys, tmp_path, monkeypatch):
    """The hint source is built before the policy: a teacher model path that is not there, or a hints file that is
    not there, exits 2 with one line naming the teacher, and nothing is loaded; a method that uses no hints builds
    no hint source (GRPO with hint_source=teacher and no teacher was a ValueError traceback, and with a teacher model
    it loaded that model for nothing)."""
    from sage_core import train
    from sage_core.data import DataError, synthetic_rows
    from sage_core.hints import write_reference_hints

    def policy(spec, output_dir):
        raise DataError("the policy loads now")

    monkeypatch.setattr(train, "_trainer_inputs", policy)
    base = ["train", "--set", "num_prompts=8", "--set", "prompts_per_step=4", "--set", "max_steps=1"]
    for teacher, needle in (("/nonexistent/teacher", "sage train: teacher /nonexistent/teacher: model not found: "),
                            (str(tmp_path / "gone.jsonl"), "sage train: teacher hints file not found: ")):
        rc, _, err = run_cli(capsys, *base, "--set", "hint_source=teacher", "--set", f"teacher={teacher}",
                             "--output-dir", str(tmp_path / "run"))
        assert rc == 2 and err.startswith(needle) and err.count("\n") == 1, err
    upper = tmp_path / "hints.JSONL"  # a hints file in upper case is read as one, not taken for a model
    write_reference_hints(synthetic_rows(8, seed=0), upper)
    rc, _, err = run_cli(capsys, *base, "--set", "hint_source=teacher", "--set", f"teacher={upper}",
                         "--output-dir", str(tmp_path / "run2"))
    assert rc == 2 and err == "sage train: the policy loads now\n"
    for teacher in ([], ["--set", "teacher=/nonexistent/teacher"]):
        rc, _, err = run_cli(capsys, *base, "--set", "method=grpo", "--set", "hint_source=teacher", *teacher,
                             "--output-dir", str(tmp_path / f"grpo{len(teacher)}"))
        assert rc == 2 and err == "sage train: the policy loads now\n"


@pytest.mark.parametrize("gpus,needle", [("-1", "--gpus -1: GPU ids are 0 or more, got -1"),
                                         ("0,-2", "--gpus 0,-2: GPU ids are 0 or more, got -2"),
                                         (" ", "--gpus '': blank; give a count (8) or ids (0,1,2)"),
                                         (",", "--gpus ',': blank")])
def test_launch_refuses_negative_and_blank_gpus(capsys, tmp_path, monkeypatch, gpus, needle):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc, out, err = run_cli(capsys, "launch", "--preset", "qwen2.5-7b", f"--gpus={gpus}", "--dry-run",
                           "--output-dir", str(tmp_path))
    assert rc == 2 and err.startswith(f"sage launch: {needle}") and "CUDA_VISIBLE_DEVICES" not in out


# ---------------------------------------------------------------------------------------------- a stopped run
@pytest.mark.parametrize("signame, codes", [("SIGTERM", (143,)), ("SIGINT", (130,))])
def test_a_stopped_train_ends_its_mlflow_run_killed_and_resumes_it_to_finished(capsys, tmp_path, tiny_model_dir,
                                                                              monkeypatch, signame, codes):
    """`sage train --mlflow` stopped after its first step: by SIGTERM (a scheduler's time limit, scancel, an
    eviction; Python's default ended the process at once, the MLflow run left RUNNING with no end time) or by Ctrl-C
    (the run was ended FAILED, and a traceback printed). Its run is KILLED with an end time, the command says it was
    stopped, and the same command run again resumes that run to FINISHED."""
    import os
    import signal
    import time

    from sage_core import tracking

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    out = tmp_path / "run"
    argv = ["train", "--set", "method=sage-light", "--set", "max_steps=2", "--set", "save_steps=1", "--set",
            "num_prompts=8", "--set", "prompts_per_step=2", "--set", "num_generations=4", "--set",
            "max_completion_length=24", "--output-dir", str(out), "--mlflow", "--experiment", "cli-stop"]
    # Ctrl-C's KeyboardInterrupt also where the tests run as a shell's background job (which ignores SIGINT)
    main = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from sage_core.cli import main; sys.exit(main())")
    log = tmp_path / "train.log"
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-c", main, *argv], cwd=ROOT, env=dict(os.environ), stdout=fh,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (out / "tracker" / "step_000001.parquet").exists():  # the first step rolled out
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        proc.send_signal(getattr(signal, signame))
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc in codes, log.read_text()[-3000:]
    said = "sage train: stopped by SIGTERM" if signame == "SIGTERM" else "sage train: stopped (Ctrl-C)"
    assert said in log.read_text() and "Traceback" not in log.read_text()  # Ctrl-C printed KeyboardInterrupt's
    rid = (out / "mlflow_run_id").read_text().strip()
    run = tracking.client().get_run(rid)
    assert run.info.status == "KILLED" and run.info.end_time is not None and not tracking.is_complete(run)
    rc, stdout, err = run_cli(capsys, *argv)
    assert rc == 0, err
    run = tracking.client().get_run(rid)
    assert f"MLflow run {rid} (resumed)" in stdout and run.info.status == "FINISHED" and tracking.is_complete(run)
    assert json.loads((out / "train_result.json").read_text())["global_step"] == 2


@pytest.mark.parametrize("stop, status", [("SIGTERM", "KILLED"), ("Ctrl-C", "KILLED"), ("error", "FAILED")])
def test_a_stopped_launch_ends_its_mlflow_run_killed(capsys, tmp_path, monkeypatch, stop, status):
    """`sage launch --mlflow` ended its run FAILED whatever stopped it, and SIGTERM ended the process before even
    that (the run stayed RUNNING, its vLLM server was not stopped). Stopped (SIGTERM: exit code 143; Ctrl-C), the
    run is KILLED; failed, FAILED. The SIGTERM handler is put back afterwards."""
    import os
    import signal
    import time

    from sage_core import launch as L
    from sage_core import tracking

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)

    def launch(*args, **kw):  # the ranks running, when the stop comes
        if stop == "SIGTERM":
            # no handler of sage's: the default one would end pytest itself
            assert signal.getsignal(signal.SIGTERM) is not handler, "no SIGTERM handler while the ranks run"
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs as soon as this returns
            time.sleep(5)
        raise KeyboardInterrupt if stop == "Ctrl-C" else RuntimeError("the ranks' launcher failed")

    monkeypatch.setattr(L, "launch", launch)
    handler = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    argv = ["launch", "--gpus", "0,", "--output-dir", str(out), "--mlflow", "--experiment", "cli-launch-stop"]
    if stop == "Ctrl-C":  # said in a line and exit code 130, as a shell reports it, not a traceback
        assert cli.main(argv) == 130 and "sage launch: stopped (Ctrl-C)" in capsys.readouterr().err
    else:
        with pytest.raises((SystemExit, RuntimeError)) as e:
            cli.main(argv)
        assert stop != "SIGTERM" or (e.type is SystemExit and e.value.code == 143
                                     and "sage launch: stopped by SIGTERM" in capsys.readouterr().err)
    assert signal.getsignal(signal.SIGTERM) is handler
    run = tracking.client().get_run((out / "mlflow_run_id").read_text().strip())
    assert run.info.status == status and run.info.end_time is not None


def test_eval_of_a_runs_model_on_heldout_takes_the_runs_heldout_rows(capsys, tmp_path, tiny_model_dir):
    """`--benchmark h=heldout` on a run's model scored the held-out rows of the command line's spec (the default
    synthetic set, 8 prompts), not those of the run's data (a 6-row file trained on its first 4: 2 rows left);
    fields given with --set still win."""
    import pandas as pd

    from sage_core.data import synthetic_rows
    from sage_core.presets import preset
    from sage_core.train import train

    data = tmp_path / "six.jsonl"
    data.write_text("".join(json.dumps({k: r[k] for k in ("problem", "solution", "answer", "prompt_id")}) + "\n"
                            for r in synthetic_rows(6, seed=5)))
    spec = preset("tiny-cpu", method="grpo", data=str(data), num_prompts=4, prompts_per_step=2, num_generations=4,
                  max_steps=1)
    train(spec, tmp_path / "run")
    for model in (tmp_path / "run", tmp_path / "run" / "final"):
        out = tmp_path / "t.parquet"
        rc, _, err = run_cli(capsys, "eval", "--model", str(model), "--benchmark", "h=heldout", "--k", "1",
                             "--num-prompts", "8", "--output", str(out), "--force")
        assert rc == 0, err
        assert "held-out rows as" in err and f"data={str(data)!r}" in err and "num_prompts=4" in err
        assert pd.read_parquet(out)["n_prompts"].tolist() == [2]  # rows 5 and 6 of the file
    rc, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "run" / "final"), "--benchmark", "h=heldout",
                         "--k", "1", "--set", "num_prompts=3", "--output", str(out), "--force")
    assert rc == 0, err
    assert pd.read_parquet(out)["n_prompts"].tolist() == [3]  # the file's rows after its first 3


def test_eval_of_a_runs_folder_scores_each_checkpoint_as_a_curve(capsys, tmp_path, tiny_model_dir):
    """`sage eval --model RUN` (a run's folder, its checkpoints kept with keep_checkpoints=None): one row per
    checkpoint and benchmark, with its step and path, each the scores of that checkpoint evaluated alone; a run's
    folder without checkpoints is named."""
    import pandas as pd

    from sage_core.data import benchmark_rows
    from sage_core.evaluate import evaluate
    from sage_core.presets import preset
    from sage_core.train import train

    spec = preset("tiny-cpu", method="grpo", num_prompts=4, prompts_per_step=2, num_generations=4, max_steps=2,
                  save_steps=1, keep_checkpoints=None)
    train(spec, tmp_path / "run")
    out = tmp_path / "curve.parquet"
    rc, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "run"), "--benchmark", "h=heldout", "--k", "2",
                         "--num-prompts", "4", "--temperature", "0", "--output", str(out))
    assert rc == 0, err
    table = pd.read_parquet(out)
    assert list(table["step"]) == [1, 2] and set(table["benchmark"]) == {"h"}
    rows = benchmark_rows(spec.model_copy(update={"eval_num_prompts": 4}), "heldout")
    for r in table.itertuples():
        alone = evaluate(r.model, {"h": rows}, k=2, temperature=0.0, max_new_tokens=spec.max_completion_length)
        assert (r.avg_at_k, r.pass_at_k) == pytest.approx((alone.avg_at_k[0], alone.pass_at_k[0]))
        assert r.model == str(tmp_path / "run" / f"checkpoint-{r.step}")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "spec.json").write_text(spec.model_dump_json())
    rc, _, err = run_cli(capsys, "eval", "--model", str(empty), "--benchmark", "h=heldout")
    assert rc == 2 and "a run's folder without checkpoint-N/ folders" in err, err


def test_eval_of_a_runs_folder_skips_checkpoints_being_saved_cut_short_or_removed(capsys, tmp_path, monkeypatch,
                                                                                  tiny_model_dir):
    """`sage eval --model RUN` while a run trains there, or after one was killed while saving: a checkpoint whose
    weights were cut short, one without trainer_state.json (being saved: a kill -9 while saving left config.json,
    generation_config.json and model.safetensors) and one the run's keep_checkpoints removed once it was listed
    failed the whole evaluation ('model not found: .../checkpoint-10 does not exist', every time on a run with
    save_steps=1 and keep_checkpoints=3), the checkpoints scored before it lost. Each is skipped, named on stderr with
    why, and the whole ones are scored; none left is an error naming them."""
    import shutil

    import pandas as pd

    from sage_core import evaluate as evaluate_module
    from sage_core.presets import preset

    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.json").write_text(preset("tiny-cpu", num_prompts=8).model_dump_json())
    for step in range(1, 6):
        shutil.copytree(tiny_model_dir, run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    weights = run / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    for name in os.listdir(run / "checkpoint-3"):  # what a kill while saving left
        if name not in ("config.json", "generation_config.json", "model.safetensors"):
            (run / "checkpoint-3" / name).unlink()
    real = evaluate_module.evaluate

    def rotating(model, *args, **kwargs):  # the run saves a checkpoint and removes checkpoint-4 meanwhile
        if model.endswith("checkpoint-1"):
            shutil.rmtree(run / "checkpoint-4")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate", rotating)
    out = tmp_path / "curve.parquet"
    argv = ["eval", "--model", str(run), "--benchmark", "h=heldout", "--k", "1", "--num-prompts", "2", "--set",
            "max_completion_length=8", "--output", str(out), "--force"]
    rc, stdout, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert pd.read_parquet(out)["step"].tolist() == [1, 5]
    assert f"skipped {run / 'checkpoint-2'} ({weights} cannot be read as safetensors" in err
    assert f"skipped {run / 'checkpoint-3'} (no trainer_state.json: being saved, or its save was cut short)" in err
    assert f"skipped {run / 'checkpoint-4'} (removed since it was listed" in err
    assert "Traceback" not in err
    shutil.rmtree(run / "checkpoint-1")
    shutil.rmtree(run / "checkpoint-5")
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and f"sage eval: --model {run}: none of its checkpoints could be evaluated" in err, err
    assert "checkpoint-2, checkpoint-3" in err


def test_a_launch_into_a_folder_being_trained_is_refused_before_its_mlflow_run(capsys, tmp_path, monkeypatch):
    """`sage launch` holds its output dir from before its MLflow run is opened, for its ranks (spec.HELD_ENV: rank 0
    takes no hold of its own there). A second launch into a folder being trained was refused only by its rank 0,
    after it had reopened the first launch's MLflow run (the folder's mlflow_run_id), which it then ended FAILED."""
    from sage_core import launch as L
    from sage_core.spec import HELD_ENV, run_folder_lock

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    (out / "mlflow_run_id").write_text("the-first-launchs-run\n")
    launched = []

    def launch(spec, output_dir, **kw):  # the ranks: rank 0 holds the folder as train() does, in a process of its own
        code = ("import sys; from sage_core.spec import run_folder_lock\n"
                f"with run_folder_lock({str(out)!r}): print('trained', flush=True)")
        r = subprocess.run([sys.executable, "-c", code], env={**kw["env"], "RANK": "0"}, cwd=ROOT,
                           capture_output=True, text=True, check=False)
        launched.append((kw["env"].get(HELD_ENV), r.stdout.strip(), r.stderr))
        return L.LaunchResult(returncode=0, plan=None, log_path=out / "launch.log", result=None, tail=[])

    monkeypatch.setattr(L, "launch", launch)
    argv = ["launch", "--gpus", "0,", "--output-dir", str(out), "--mlflow"]
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from sage_core.spec import run_folder_lock\n"
                               f"with run_folder_lock({str(out)!r}):\n print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, _, err = run_cli(capsys, *argv)
    finally:
        holder.communicate("")
    assert rc == 2 and not launched, err
    assert f"is being trained by another process (pid {holder.pid})" in err, err
    assert (out / "mlflow_run_id").read_text() == "the-first-launchs-run\n"
    assert not (tmp_path / "home").exists()  # no MLflow store was opened
    (out / "mlflow_run_id").unlink()
    rc, _, err = run_cli(capsys, *argv)  # the folder free: the launch holds it, and its rank 0 trains under that hold
    assert rc == 0, err
    assert launched == [(str(out.resolve()), "trained", "")]
    with run_folder_lock(out):  # the launch's hold ended with it
        pass
