"""RunSpec: values that would train nonsense are refused when the spec is made, naming the field."""

import os
import re

import pytest
from pydantic import ValidationError

from sage_core.spec import RunSpec


@pytest.mark.parametrize("field,value,says", [
    ("learning_rate", float("inf"), "finite"),  # trained to all-NaN weights, exit 0, before
    ("temperature", float("inf"), "finite"),
    ("beta", float("nan"), "finite"),
    ("light_min", float("nan"), "finite"),
    ("epsilon", -5.0, "greater than or equal to 0"),
    ("epsilon_high", -0.1, "greater than or equal to 0"),
    ("beta", -0.01, "greater than or equal to 0"),
])
def test_non_finite_or_negative_values_are_refused(field, value, says):
    with pytest.raises(ValidationError, match=rf"{field}\n.*{says}"):
        RunSpec(**{field: value})


def test_the_bounds_keep_the_usual_values():
    s = RunSpec(epsilon=0.0, beta=0.04, epsilon_high=0.0)
    assert (s.epsilon, s.beta, s.epsilon_high) == (0.0, 0.04, 0.0)


@pytest.mark.parametrize("data", ["/d/train.jsonl", "/d/rows.parquet", "/d/rows.JSON", "synthetic"])
def test_a_split_of_a_source_that_has_none_is_refused(data):
    """data_split was silently ignored for a file (every row read) and the synthetic task: a user asking for its
    'test' split trained on the file's first rows."""
    with pytest.raises(ValidationError, match="data_split='test' picks a split of a data set.*drop data_split"):
        RunSpec(data=data, data_split="test")
    assert RunSpec(data=data).data_split == "train"
    assert RunSpec(data="/d/folder", data_split="test").data_split == "test"  # a data set's folder has splits


@pytest.mark.parametrize("model,what", [("tiny", "built in"), ("smollm2", "built in"),
                                        ("/m/SmolLM2.Q4_1.gguf", "a .gguf file itself")])
def test_a_gguf_file_for_a_model_with_no_folder_to_hold_it_is_refused(model, what):
    """gguf_file names a file inside `model`'s folder: with the built-in models it was silently ignored (the tiny
    model trained), and with a .gguf path it was looked for inside the file."""
    with pytest.raises(ValidationError, match=f"gguf_file='x.gguf' names a file inside the model folder, and model "
                                              f"'{re.escape(model)}' is {what}: drop gguf_file"):
        RunSpec(model=model, gguf_file="x.gguf")
    assert RunSpec(model="/m/folder", gguf_file="x.gguf").gguf_file == "x.gguf"


def test_a_run_folder_is_held_by_one_trainer_at_a_time(tmp_path, monkeypatch):
    """run_folder_lock: train() (and `sage train`) hold their output dir; another thread or process is refused
    naming the folder, a hold nested in the same thread (the CLI's, then train()'s) is the one held, a rank other
    than the main process takes none (every rank trains there), and the hold ends with the block."""
    import threading

    from sage_core.spec import RunFolderTaken, run_folder_lock
    from sage_core.train import train

    out, errors = tmp_path / "run", []

    def other():
        try:
            with run_folder_lock(out):
                pass
        except RunFolderTaken as e:
            errors.append(str(e))

    with run_folder_lock(out):
        with run_folder_lock(out):  # nested: the same hold
            pass
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert errors == [f"{out} is being trained by another process (pid {os.getpid()}): wait for it to end (it "
                          "resumes from its checkpoints), or train in another output dir"]
        monkeypatch.setenv("RANK", "1")
        with run_folder_lock(out):
            pass
        monkeypatch.delenv("RANK")
        errors.clear()
        thread = threading.Thread(target=lambda: errors.append(pytest.raises(RunFolderTaken, train, RunSpec(), out)))
        thread.start()
        thread.join()
        assert "is being trained by another process" in str(errors[0].value)
    errors.clear()
    other()
    assert errors == []



def test_a_run_folder_on_a_file_system_without_locks_is_trained_unheld(tmp_path, monkeypatch, caplog):
    """A cluster's file system that does not lock files (flock: ENOLCK on NFS without lockd, EOPNOTSUPP on Lustre
    mounted without flock) trains unheld, with a warning naming the folder: it raised the OSError, and no run
    could train there."""
    import errno
    import fcntl

    from sage_core.spec import run_folder_lock

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    ran = []
    with caplog.at_level("WARNING", logger="sage_core.spec"), run_folder_lock(tmp_path / "run"):
        ran.append(True)
    assert ran == [True]
    assert f"{tmp_path / 'run'}: not held against a second trainer: its file system does not lock files (No locks " \
           "available)" in caplog.text


def test_a_folder_that_is_no_runs_is_refused_when_training_would_write_over_its_files(tmp_path):
    """TRL writes its model card README.md into the output dir, and train() a summary.json: a user's folder holding
    such files is refused (they were overwritten); other files, an empty folder or a new one are fine."""
    from sage_core.spec import RunFolderTaken, check_run_folder

    (tmp_path / "notes.txt").write_text("mine")
    check_run_folder(RunSpec(), tmp_path)
    check_run_folder(RunSpec(), tmp_path / "new")
    (tmp_path / "README.md").write_text("# my experiment notes")
    with pytest.raises(RunFolderTaken, match=r"not a run's folder and holds README.md"):
        check_run_folder(RunSpec(), tmp_path)
    assert (tmp_path / "README.md").read_text() == "# my experiment notes"
    (tmp_path / "checkpoint-1").mkdir()  # checkpoints without spec.json: another trainer's output dir
    with pytest.raises(RunFolderTaken, match=r"no spec.json: not a SAGE run's folder"):
        check_run_folder(RunSpec(), tmp_path)
    (tmp_path / "spec.json").write_text(RunSpec().model_dump_json())  # a run's folder: its own model card
    check_run_folder(RunSpec(), tmp_path)


def test_a_users_spec_file_in_the_output_folder_is_not_replaced_by_another_spec(tmp_path):
    """`--spec exp/spec.json --output-dir exp`: train() writes the spec it trains to exp/spec.json. A spec.json no run
    wrote (it lacks fields) that differs from that spec is refused (the user's file was replaced); the same spec,
    or a run's own full spec.json of a run that failed before its first step, is fine."""
    import json

    from sage_core.spec import RunFolderTaken, check_run_folder

    mine = json.dumps({"method": "sage", "max_steps": 5})
    (tmp_path / "spec.json").write_text(mine)
    check_run_folder(RunSpec(method="sage", max_steps=5), tmp_path)  # what the file says: rewritten the same
    with pytest.raises(RunFolderTaken, match=r"not a run's folder and holds spec.json \(not one a run wrote"):
        check_run_folder(RunSpec(method="grpo", max_steps=5), tmp_path)
    assert (tmp_path / "spec.json").read_text() == mine
    with pytest.raises(RunFolderTaken, match=r"this spec differs: max_steps 5 -> 9"):  # resumable for runs only
        check_run_folder(RunSpec(method="sage", max_steps=9), tmp_path)
    # the fields it does not name come from the preset, not from RunSpec's defaults: that is no change
    from sage_core.presets import PRESETS

    for name in PRESETS:
        check_run_folder(RunSpec(**{**PRESETS[name], "method": "sage", "max_steps": 5}), tmp_path)
    (tmp_path / "spec.json").write_text(RunSpec(method="sage").model_dump_json())  # a run's, failed before step 1
    check_run_folder(RunSpec(method="grpo"), tmp_path)


def test_an_mlflow_run_id_alone_is_no_run(tmp_path):
    """A run that failed before its first step with --mlflow leaves spec.json and mlflow_run_id: nothing trained,
    so the folder takes another spec; once it holds trained steps (tracker files) it is that spec's run."""
    from sage_core.spec import RunFolderTaken, check_run_folder

    (tmp_path / "spec.json").write_text(RunSpec(data="rows1.jsonl").model_dump_json())
    (tmp_path / "mlflow_run_id").write_text("0123abcd\n")
    check_run_folder(RunSpec(data="rows2.jsonl"), tmp_path)
    (tmp_path / "tracker").mkdir()
    (tmp_path / "tracker" / "step_000001.parquet").write_bytes(b"")
    with pytest.raises(RunFolderTaken, match=r"another spec \(data 'rows1.jsonl' -> 'rows2.jsonl'\)"):
        check_run_folder(RunSpec(data="rows2.jsonl"), tmp_path)


def test_one_reader_of_a_runs_spec_json(tmp_path):
    """recorded_fields reads `<out>/spec.json` (for spec_changes, hence check_run_folder) and recorded_spec validates
    it (for the flows' folder_for): fields the file lacks at their defaults; None where there is none or it is
    unreadable, and for recorded_spec one this RunSpec refuses, which spec_changes still compares as recorded."""
    from sage_core.spec import RunFolderTaken, check_run_folder, recorded_fields, recorded_spec, spec_changes

    assert recorded_spec(tmp_path) is None and recorded_fields(tmp_path / "new") is None
    spec = RunSpec(data="rows1.jsonl", max_steps=3)
    (tmp_path / "spec.json").write_text(spec.model_dump_json(indent=2))
    assert recorded_spec(tmp_path) == spec and recorded_spec(str(tmp_path)) == spec
    assert recorded_fields(tmp_path) == spec.model_dump()
    (tmp_path / "spec.json").write_text('{"method": "grpo"}')
    assert recorded_spec(tmp_path) == RunSpec(method="grpo")
    assert spec_changes(RunSpec(method="grpo", max_steps=5), tmp_path) == []  # resumable field only
    assert spec_changes(RunSpec(), tmp_path) == ["method 'grpo' -> 'sage'"]
    (tmp_path / "tracker").mkdir()
    (tmp_path / "tracker" / "step_000001.parquet").write_bytes(b"")
    with pytest.raises(RunFolderTaken, match=r"another spec \(method 'grpo' -> 'sage'\)"):
        check_run_folder(RunSpec(), tmp_path)
    for unreadable in ("{not json", "[1, 2]", ""):
        (tmp_path / "spec.json").write_text(unreadable)
        assert recorded_fields(tmp_path) is None and recorded_spec(tmp_path) is None
        assert spec_changes(RunSpec(), tmp_path) == []
        check_run_folder(RunSpec(), tmp_path)  # unreadable: passes
    for refused in ('{"method": "nope"}', '{"method": "grpo", "field_of_another_version": 1}'):
        (tmp_path / "spec.json").write_text(refused)
        assert recorded_spec(tmp_path) is None and recorded_fields(tmp_path)["method"] in ("nope", "grpo")
        with pytest.raises(RunFolderTaken, match=r"another spec \(method '(nope|grpo)' -> 'sage'\)"):
            check_run_folder(RunSpec(), tmp_path)


def test_relative_paths_are_made_absolute_where_the_spec_is_built(tmp_path, monkeypatch):
    """teacher=hints.jsonl (data=, model= alike) is the file in the working directory the spec was built in: a run
    resumed from another directory is refused as another spec instead of silently reading that directory's file;
    built-in names, URLs and names of no local file stay as given. A folder recorded with a relative path (before
    this) resumes where that path names the same file."""
    from sage_core.cli import build_spec
    from sage_core.spec import RunFolderTaken, check_run_folder

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "hints.jsonl").write_text("")
        (d / "rows.jsonl").write_text("")
    monkeypatch.chdir(a)
    spec = build_spec("tiny-cpu", None, ["method=sage", "hint_source=teacher", "teacher=hints.jsonl",
                                         "data=rows.jsonl"])
    assert (spec.teacher, spec.data, spec.model) == (str(a / "hints.jsonl"), str(a / "rows.jsonl"), "tiny")
    assert build_spec(None, None, ["teacher=http://h:8000/v1", "data=org/set"]).teacher == "http://h:8000/v1"
    assert build_spec(None, None, ["data=org/set"]).data == "org/set"  # no such local path: a hub name
    (a / "ds").mkdir()  # a local dataset folder with a configuration
    assert build_spec(None, None, ["data=ds:main"]).data == f"{a}/ds:main"
    assert build_spec(None, None, ["data=openai/gsm8k:main"]).data == "openai/gsm8k:main"
    run = tmp_path / "run"
    (run / "tracker").mkdir(parents=True)
    (run / "tracker" / "step_000001.parquet").write_bytes(b"")
    (run / "spec.json").write_text(spec.model_dump_json())
    monkeypatch.chdir(b)
    again = build_spec("tiny-cpu", None, ["method=sage", "hint_source=teacher", "teacher=hints.jsonl",
                                          "data=rows.jsonl"])
    with pytest.raises(RunFolderTaken, match=rf"teacher '{a}/hints.jsonl' -> '{b}/hints.jsonl'"):
        check_run_folder(again, run)
    check_run_folder(spec, run)  # the same files, named from anywhere
    (run / "spec.json").write_text(spec.model_copy(update={"teacher": "hints.jsonl", "data": "rows.jsonl"})
                                   .model_dump_json())  # recorded relative, by an earlier version
    check_run_folder(again, run)  # from b, the recorded names are b's files: what this spec names
    with pytest.raises(RunFolderTaken, match=r"teacher 'hints.jsonl' -> "):
        check_run_folder(spec, run)



def test_eval_every_is_the_same_run_with_the_same_key_and_can_change_on_resume(tmp_path):
    """eval_every and eval_data (evaluation while training, added after runs existed) do not change what is
    trained: a spec keeps the key it had before the fields existed, with them set or not, and a run continues
    under other values."""
    import hashlib
    import json

    from sage_core.spec import RunSpec, check_run_folder

    spec = RunSpec(method="sage-light", max_steps=3)
    fields = spec.model_dump()
    for added in ("eval_every", "eval_data", "keep_checkpoints", "shared_prefix", "hint_drafts",
                  "shared_prefill", "hint_prefetch"):  # as before them
        fields.pop(added)
    before = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    assert spec.key() == before == spec.model_copy(update={"eval_every": 5, "eval_data": "synthetic",
                                                           "keep_checkpoints": None, "shared_prefix": False,
                                                           "hint_drafts": False, "shared_prefill": False,
                                                           "hint_prefetch": False}).key()
    assert spec.key() != spec.model_copy(update={"max_steps": 4}).key()
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    (tmp_path / "tracker").mkdir()
    (tmp_path / "tracker" / "step_000001.parquet").write_bytes(b"")
    check_run_folder(spec.model_copy(update={"eval_every": 2, "eval_data": "x.jsonl", "keep_checkpoints": 5}),
                     tmp_path)  # no RunFolderTaken


@pytest.mark.parametrize("url", ["http://alice:s3cret@h:8000/v1", "https://s3cret@h/v1",
                                 "http://h:8000/v1?api_key=s3cret", "http://h:8000/v1#s3cret", "http://h:8000/v1?"])
def test_a_teacher_url_with_a_user_password_or_query_is_refused(url):
    """A key in the teacher URL was accepted (httpx sent the user and password as basic auth) and went, as the URL,
    into spec.json, the MLflow param sage.teacher, every `sage hints` row and the 'waiting for the teacher' lines;
    a query key was sent nowhere ('/v1?api_key=k/models'). The key goes in SAGE_TEACHER_API_KEY."""
    with pytest.raises(ValidationError, match="no user, password or query.*SAGE_TEACHER_API_KEY") as e:
        RunSpec(method="sage", hint_source="teacher", teacher=url)
    assert "s3cret" not in e.value.errors()[0]["msg"]
    for fine in ("http://h:8000/v1", "https://h/v1/", "/models/teacher", "hints.jsonl"):
        assert RunSpec(method="sage", hint_source="teacher", teacher=fine).teacher == fine
