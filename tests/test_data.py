"""Synthetic task, reference hints, and loading external data into the row schema."""

from __future__ import annotations

import hashlib
import json
import re
import warnings

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_core import data, prompts
from sage_core.data import build_dataset, eval_rows, load_rows, reference_hint, synthetic_rows
from sage_core.spec import RunSpec

SCHEMA = {"prompt", "problem", "solution", "answer", "prompt_id", "difficulty"}
CONTRACT_ROW = {"problem": "Ann has 7 coins . She gets 5 more . She gives away 3 . How many coins does Ann have now ?",
                "solution": "7 + 5 = 12 . 12 - 3 = 9 . The answer is \\boxed{9} .", "answer": "9"}


def _check_row_arithmetic(row):
    steps = data.parse_steps(row["solution"])
    assert len(steps) == row["difficulty"]
    first_number = int(re.search(r"\d+", row["problem"]).group())
    assert steps[0][1] == first_number
    value = first_number
    for op, lhs, n, r in steps:
        assert lhs == value
        assert r == {"+": lhs + n, "-": lhs - n, "*": lhs * n}[op]
        assert 1 <= r <= data.MAX_VALUE
        value = r
    assert row["answer"] == str(value)
    assert row["solution"].endswith(f"The answer is \\boxed{{{value}}} .")
    # the problem mentions each operand once per step, in order
    numbers = [int(x) for x in re.findall(r"\d+", row["problem"])]
    assert numbers == [first_number] + [n for _, _, n, _ in steps]


def test_contract_example_hints():
    assert reference_hint(CONTRACT_ROW, 1) == "Use + then - ."
    assert reference_hint(CONTRACT_ROW, 2) == "First 7 + 5 = 12 ."
    assert reference_hint(CONTRACT_ROW, 3) == "7 + 5 = 12 . Then 12 - 3 ."
    with pytest.raises(ValueError):
        reference_hint(CONTRACT_ROW, 0)


def test_one_step_hints_never_state_the_result():
    row = {"solution": "7 + 5 = 12 . The answer is \\boxed{12} .", "answer": "12"}
    assert reference_hint(row, 1) == "Use + ."
    assert reference_hint(row, 2) == "First 7 + 5 ."
    assert reference_hint(row, 3) == "Then 7 + 5 ."


def test_synthetic_rows_schema_determinism_and_ids():
    rows = synthetic_rows(50, seed=4)
    assert all(set(r) == SCHEMA for r in rows)
    assert rows == synthetic_rows(50, seed=4)
    assert rows != synthetic_rows(50, seed=5)
    assert [r["prompt_id"] for r in rows] == [f"syn-4-{i}" for i in range(50)]
    # a longer list keeps the rows of a shorter one (ids are stable)
    assert synthetic_rows(80, seed=4)[:50] == rows
    for r in rows:
        assert r["prompt"] == [{"role": "user", "content": r["problem"]}]
        _check_row_arithmetic(r)


def test_difficulties():
    assert {r["difficulty"] for r in synthetic_rows(100, difficulty="easy")} == {1}
    assert {r["difficulty"] for r in synthetic_rows(200, difficulty="hard")} == {3, 4}
    mixed = [r["difficulty"] for r in synthetic_rows(800, difficulty="mixed")]
    assert set(mixed) == {1, 2, 3, 4}
    assert all(150 <= mixed.count(d) <= 250 for d in (1, 2, 3, 4))
    with pytest.raises(ValueError):
        synthetic_rows(3, difficulty="medium")


def test_text_is_space_separated_words():
    for r in synthetic_rows(100, seed=1):
        for text in (r["problem"], r["solution"]):
            assert " ".join(text.split()) == text
        assert r["problem"].endswith(" ?")
        words = r["problem"].split()
        assert all(w in (".", "?") or w.isalpha() or w.isdigit() for w in words)


def test_text_uses_varied_names_objects_and_verbs():
    rows = synthetic_rows(300, seed=2)
    names = {r["problem"].split()[0] for r in rows}
    objects = {r["problem"].split()[3] for r in rows}
    assert len(names) >= 10 and len(objects) >= 8
    verbs = {w for r in rows for w in r["problem"].split() if w in ("gets", "finds", "buys", "wins", "loses",
                                                                    "sells", "uses", "gives")}
    assert len(verbs) >= 6


def test_reference_hints_never_contain_the_answer():
    for r in synthetic_rows(600, seed=9):
        words_of_problem = set(r["problem"].split())
        assert r["answer"] not in words_of_problem
        for level in prompts.LEVELS:
            hint = reference_hint(r, level)
            assert r["answer"] not in hint.split(), (r, level, hint)
            assert "boxed" not in hint
        assert not re.search(r"\d", reference_hint(r, 1))
        steps = data.parse_steps(r["solution"])
        assert reference_hint(r, 3).count("=") == len(steps) - 1


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 20), difficulty=st.sampled_from(["easy", "mixed", "hard"]))
def test_synthetic_rows_are_always_valid(seed, n, difficulty):
    rows = synthetic_rows(n, seed=seed, difficulty=difficulty)
    assert len(rows) == n and len({r["prompt_id"] for r in rows}) == n
    for r in rows:
        _check_row_arithmetic(r)


def test_generic_hints_for_other_solution_formats():
    row = {"solution": "Let x be the number. Then 2x = 10. So x is 5. Final: \\boxed{5}.", "answer": "5"}
    for level in prompts.LEVELS:
        h = reference_hint(row, level)
        assert "5" not in re.findall(r"\d+", h) and "boxed" not in h
    assert reference_hint(row, 1) == "Let x be the number."
    assert reference_hint({"solution": "", "answer": "5"}, 2) == ""


# ------------------------------------------------------------------------------------------------------------
# loading files
# ------------------------------------------------------------------------------------------------------------

def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_load_parquet_with_aliases_and_chat_prompts(tmp_path):
    df = pd.DataFrame({
        "prompt": [[{"role": "user", "content": "What is 2 + 2 ?"}], [{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "Half of 1 ?"}]],
        "ground_truth": ["\\boxed{4}", "\\frac{1}{2}"],
        "solution": ["2 + 2 = 4 .", "1 / 2 ."],
        "extra_info": [{"index": 10}, {"index": 11}],
    })
    path = tmp_path / "train.parquet"
    df.to_parquet(path)
    before = _sha(path)
    ds = load_rows(str(path))
    assert _sha(path) == before
    assert set(ds.column_names) == SCHEMA
    rows = list(ds)
    assert [r["answer"] for r in rows] == ["4", "\\frac{1}{2}"]
    assert [r["problem"] for r in rows] == ["What is 2 + 2 ?", "Half of 1 ?"]
    assert [r["prompt_id"] for r in rows] == ["10", "11"]
    assert rows[1]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert [r["difficulty"] for r in rows] == [-1, -1]


def test_load_jsonl_problem_only_and_missing_solution_warns(tmp_path):
    path = tmp_path / "d.jsonl"
    recs = [{"question": "What is 3 * 3 ?", "final_answer": 9}, {"question": "What is 1 + 1 ?", "gt": "2"}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    with pytest.warns(UserWarning, match="answer-free"):
        ds = load_rows(str(path), system_prompt=prompts.SYSTEM_PROMPT)
    rows = list(ds)
    assert rows[0]["prompt"] == prompts.chat("What is 3 * 3 ?", prompts.SYSTEM_PROMPT)
    assert [r["answer"] for r in rows] == ["9", "2"]
    assert [r["solution"] for r in rows] == ["", ""]
    # ids: a stable hash of the problem
    with pytest.warns(UserWarning):
        assert rows[0]["prompt_id"] == list(load_rows(str(path)))[0]["prompt_id"]
    assert rows[0]["prompt_id"] != rows[1]["prompt_id"]
    # as a benchmark (evaluated, never hinted) the missing solutions are nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(data.load_benchmark(str(path)))[0]["prompt_id"] == rows[0]["prompt_id"]


def test_load_json_list_with_limit_and_string_prompts(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": f"q{i} ?", "answer": str(i), "solution": "s", "id": f"a{i}",
                                 "difficulty": 2} for i in range(5)]))
    ds = load_rows(str(path), limit=3)
    assert len(ds) == 3
    assert ds[0]["prompt"] == [{"role": "user", "content": "q0 ?"}] and ds[0]["problem"] == "q0 ?"
    assert ds["prompt_id"] == ["a0", "a1", "a2"] and ds["difficulty"] == [2, 2, 2]


@pytest.mark.filterwarnings("ignore:.*answer-free")
@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.txt"])
def test_a_utf8_file_that_starts_with_a_byte_order_mark_is_read(tmp_path, name):
    """UTF-8 with a byte order mark (Notepad, PowerShell 5's Out-File, Excel's "UTF-8" export) is UTF-8 text: its
    rows are read, not a 'line 1 is not valid JSON (Unexpected UTF-8 BOM)'."""
    records = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "What is 3 + 3?", "answer": "6"}]
    text = json.dumps(records) if name.endswith(".json") else "\n".join(json.dumps(r) for r in records)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8-sig")
    assert load_rows(str(path))["answer"] == ["4", "6"]


def test_a_json_file_of_json_lines_is_read_as_json_lines(tmp_path):
    """datasets' Dataset.to_json writes JSON lines into a .json file by default; a bad line is then named."""
    import datasets

    path = tmp_path / "d.json"
    datasets.Dataset.from_list([{"problem": f"q{i} ?", "answer": str(i), "solution": "s", "id": f"a{i}"}
                                for i in range(3)]).to_json(path)
    assert load_rows(str(path))["prompt_id"] == ["a0", "a1", "a2"]
    path.write_text(path.read_text() + '{"problem": "q", answer: 2}\n')
    with pytest.raises(data.DataError, match=r"d.json: line 4 is not valid JSON"):
        load_rows(str(path))


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_duplicate_ids_are_rejected(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": "1", "id": i % 2}) for i in range(4)))
    with pytest.raises(ValueError, match=r"dup.jsonl: 2 prompt ids are given to more than one row, e.g. "
                                         r"\['0', '1'\]"):
        load_rows(str(path))


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_rows_that_repeat_a_problem_without_ids_are_named_by_row(tmp_path):
    """A row without an id has one made from its problem ('h-...', in no file): rows repeating a problem (as scraped
    sets do) share it, and the error names those rows, so that they can be found; held-out rows by their row."""
    path = tmp_path / "rep.jsonl"
    path.write_text("\n".join(json.dumps({"problem": p, "answer": "1"}) for p in ("a", "b", "c", "b", "b")))
    with pytest.raises(data.DataError, match=r"rep.jsonl: 1 prompt ids are given to more than one row, e.g. "
                                             r"\['h-[0-9a-f]{12}'\] \(rows 1, 3 and 4 share 'h-[0-9a-f]{12}'; a row "
                                             r"without an id has one made from its problem"):
        load_rows(str(path))
    spec = RunSpec(data=str(path), num_prompts=2, prompts_per_step=2, eval_num_prompts=3)
    with pytest.raises(data.DataError, match=r"\(rows 3 and 4 share"):
        eval_rows(spec)


@pytest.mark.parametrize("columns,missing", [({"problem": "p", "solution": "s"}, "answer"),
                                             ({"text": "p", "answer": "1"}, "prompt")])
def test_missing_columns_are_named(tmp_path, columns, missing):
    path = tmp_path / "bad.parquet"
    pd.DataFrame([columns]).to_parquet(path)
    with pytest.raises(ValueError) as e:
        load_rows(str(path))
    msg = str(e.value)
    assert f"'{missing}'" in msg and str(path) in msg
    for col in columns:
        assert col in msg


def test_synthetic_source_and_missing_file(tmp_path):
    ds = load_rows("synthetic", n=12, difficulty="hard", seed=3)
    assert len(ds) == 12 and set(ds["difficulty"]) <= {3, 4}
    assert ds["prompt_id"][0] == "syn-3-0"
    with pytest.raises(FileNotFoundError, match="data file not found"):  # also a DataError
        load_rows(str(tmp_path / "nope.parquet"))


@pytest.mark.parametrize("name,content,needle", [
    ("lines.jsonl", '{"problem": "p", "answer": "1"}\n\n{"problem": "q", answer: 2}\n',
     r"line 3 is not valid JSON .*'\{\"problem\": \"q\", answer: 2\}'"),
    ("list.jsonl", '{"problem": "p", "answer": "1"}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
    ("broken.json", '[{"problem": "p",\n "answer": }]', "not valid JSON at line 2 column"),
    ("chat.jsonl", '{"prompt": [["user", "hi"]], "answer": "1"}\n', "row 0: 'prompt' must be a string or a list"),
    ("table.parquet", "not parquet", "not a readable Parquet file"),
    ("null.jsonl", ('{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}\n'
                    '{"prompt": [{"role": "user", "content": null}], "answer": "1"}\n'),
     "row 1: 'prompt' must be a string or a list"),  # not the text "None"
    ("image.jsonl", ('{"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], '
                     '"answer": "1"}\n'), "row 0: 'prompt' must be a string or a list"),
])
def test_malformed_files_name_the_file_and_the_place(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    before = path.read_bytes()
    with pytest.raises(data.DataError, match=needle) as e:
        load_rows(str(path))
    assert str(path) in str(e.value)
    assert path.read_bytes() == before  # the input is only read


@pytest.mark.parametrize("cells,needle", [
    ({"prompt": "   ", "answer": "1"}, r"row 1 has no 'prompt' \(or 'problem'/'question'\), or only a blank one"),
    ({"prompt": "q", "answer": " "}, r"row 1 has no 'answer' .*or only a blank one"),
    ({"prompt": "q", "answer": "\\boxed{}"}, r"row 1: 'answer' '\\\\boxed\{\}' is empty"),
    ({"prompt": "q", "answer": [1, 2]}, r"row 1: 'answer' must be a string or a number, got a list: '\[1, 2\]'"),
    ({"prompt": "q", "answer": {"a": 1}}, r"row 1: 'answer' must be a string or a number, got a dict"),
])
def test_blank_or_nested_cells_are_named_by_row(tmp_path, cells, needle):
    """A blank prompt or answer, or an answer that is a list or a dict, is not a gold answer to train on."""
    rows = [{"prompt": "p", "answer": "1", "id": "a"}, {**cells, "id": "b"}]
    jl = tmp_path / "rows.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(data.DataError, match=needle):
        load_rows(str(jl))
    if isinstance(cells["answer"], (list, dict)):  # the same from Parquet, where nested types are typed columns
        pq = tmp_path / "rows.parquet"
        pd.DataFrame([{**rows[0], "answer": type(cells["answer"])()}, rows[1]]).to_parquet(pq)
        with pytest.raises(data.DataError, match="row 0: 'answer' must be a string or a number"):
            load_rows(str(pq))


@pytest.mark.parametrize("content,needle", [("[1, 2]", "row 0 is a JSON number"),
                                            ('[{"problem": "p", "answer": "1"}, "q"]', "row 1 is a JSON string"),
                                            ('{"data": [null]}', "row 0 is a JSON null"),
                                            ('[[["problem", "p"]]]', "row 0 is a JSON array")])
def test_a_json_file_whose_rows_are_not_objects_is_named_by_row(tmp_path, content, needle):
    """A .json list (or a list under 'data'/'rows'/the split) of things that are not objects: a DataError naming the
    file and the row, as for a JSON lines file, not a TypeError from dict() deep in normalise_records; a hints file
    (read by the same reader) too."""
    from sage_core.hints import read_hint_variants

    path = tmp_path / "rows.json"
    path.write_text(content)
    with pytest.raises(data.DataError, match=needle) as e:
        load_rows(str(path))
    assert str(path) in str(e.value) and "not an object with columns" in str(e.value)
    with pytest.raises(data.DataError, match=needle):
        read_hint_variants(path)


def test_unsupported_file_types_and_folders_are_named(tmp_path):
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\nq,1\n")
    with pytest.raises(data.DataError, match=r"rows.csv: line 1 is not valid JSON .*a '.csv' file is read as JSON "
                                             r"lines; data files are .parquet, .jsonl or .json"):
        load_rows(str(csv))
    folder = tmp_path / "rows.jsonl"
    folder.mkdir()
    with pytest.raises(data.DataError, match="rows.jsonl: cannot be read as a data file"):
        load_rows(str(folder))


@pytest.mark.parametrize("prompt", [[{"role": "user", "content": "   "}],
                                    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}],
                                    [{"role": "user", "content": [{"type": "text", "text": " "}]}]])
def test_a_chat_prompt_with_a_blank_user_turn_is_named_by_row(tmp_path, prompt):
    """A chat prompt whose user turn is blank is no question, as a blank string prompt is not: a DataError naming
    the row, not a row trained on an empty question (and, for two such rows, a misleading error about the hash id
    their blank problems share)."""
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2 ?"}], "answer": "4"},
            {"prompt": prompt, "answer": "7"}, {"prompt": prompt, "answer": "8"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(data.DataError, match=r"rows.jsonl: row 1: the prompt's last user turn is blank"):
        load_rows(str(path))


def test_an_unknown_dataset_name_offline_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    with pytest.raises(data.DataError, match="no_such_dataset: no such local file or folder; as a Hugging Face"):
        load_rows("no_such_dataset")


@pytest.mark.parametrize("column", ["problem", "solution", "answer", "id"])
def test_text_that_is_not_valid_unicode_is_named_by_row(tmp_path, column):
    """JSON may escape half of an emoji's surrogate pair ("\ud83d", a string cut by a tool counting UTF-16 units):
    Python decodes it to a lone surrogate, which no UTF-8 writer takes. It failed deep in hashlib or in pyarrow
    (datasets' from_list) with a UnicodeEncodeError naming no file or row; now a DataError names both and the
    column."""
    row = {"problem": "What is 2 + 2 ?", "solution": "2 + 2 = 4 .", "answer": "4", "id": "a"}
    bad = json.dumps(row | {"id": "b", column: "x"}).replace('"x"', '"5 \\ud83d"')
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n" + bad + "\n")
    with pytest.raises(data.DataError, match=rf"rows.jsonl: row 1: its '{'prompt_id' if column == 'id' else column}' "
                                             r"is not valid Unicode text: it holds a lone surrogate \(U\+D83D"):
        load_rows(str(path))


def test_build_dataset_and_held_out_eval_rows():
    spec = RunSpec(num_prompts=40, eval_num_prompts=30, seed=2, difficulty="easy")
    train = build_dataset(spec)
    assert len(train) == 40 and set(train["difficulty"]) == {1}
    assert train[0]["prompt"] == [{"role": "user", "content": train[0]["problem"]}]  # tiny: no system turn
    ev = eval_rows(spec)
    assert len(ev) == 30 and set(ev["difficulty"]) > {1}
    assert not set(ev["problem"]) & set(train["problem"])
    assert not set(ev["prompt_id"]) & set(train["prompt_id"])
    real = RunSpec(model="smollm2", num_prompts=4, eval_num_prompts=4)
    assert build_dataset(real)[0]["prompt"][0] == {"role": "system", "content": prompts.SYSTEM_PROMPT}


def test_eval_rows_from_a_file_are_the_rows_after_the_training_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": str(i), "solution": "s"})
                              for i in range(10)))
    spec = RunSpec(data=str(path), num_prompts=6, eval_num_prompts=3)
    assert build_dataset(spec)["problem"] == [f"p{i}" for i in range(6)]
    assert eval_rows(spec)["problem"] == ["p6", "p7", "p8"]
    # a bad held-out row is named by its row in the file (counted from 0, as a training row is), not in the slice
    lines = path.read_text().splitlines()
    lines[7] = json.dumps({"problem": " ", "answer": "7"})
    path.write_text("\n".join(lines))
    with pytest.raises(data.DataError, match=r"row 7 has no 'prompt'"):
        eval_rows(spec)


def test_chat_content_given_as_text_parts_is_their_text(tmp_path):
    """OpenAI-style content parts ([{"type": "text", "text": ...}]) are the text they hold, not the list's repr."""
    parts = [{"type": "text", "text": "Solve:"}, {"type": "text", "text": "2 + 2 ?"}]
    row = data.normalise_records([{"prompt": [{"role": "user", "content": parts}], "answer": 4}])[0]
    assert row["prompt"][-1] == {"role": "user", "content": "Solve:\n2 + 2 ?"} and row["problem"] == "Solve:\n2 + 2 ?"


def test_held_out_rows_of_a_data_set_trained_on_its_test_split_are_not_its_training_rows(tmp_path):
    """Training on a data set's 'test' split (MATH-500 has no other): the held-out rows are its 'validation' split
    where there is one, else the test rows after the training ones (they were the training rows themselves)."""
    d = tmp_path / "ds"
    d.mkdir()
    (d / "test.jsonl").write_text("\n".join(json.dumps({"problem": f"t{i}", "answer": str(i)}) for i in range(10)))
    spec = RunSpec(data=str(d), data_split="test", num_prompts=4, prompts_per_step=4, eval_num_prompts=3)
    assert build_dataset(spec)["problem"] == ["t0", "t1", "t2", "t3"]
    assert eval_rows(spec)["problem"] == ["t4", "t5", "t6"]
    with pytest.raises(data.DataError, match="no rows left for evaluation after the first 10 training rows"):
        eval_rows(spec.model_copy(update={"num_prompts": 10}))
    (d / "validation.jsonl").write_text(json.dumps({"problem": "v0", "answer": "0"}))
    assert eval_rows(spec)["problem"] == ["v0"]
    assert eval_rows(spec.model_copy(update={"data_split": "validation"}))["problem"] == ["t0", "t1", "t2"]


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_a_folder_written_by_save_to_disk_loads_a_dataset_or_a_split_of_a_dataset_dict(tmp_path):
    """`datasets`' save_to_disk folders: a DatasetDict's split by name (a MissingSplit naming the splits it has where
    it lacks one); a single Dataset has no splits: it is the data whatever split is asked, held out as a file is."""
    import datasets

    def rows(prefix, n):
        return datasets.Dataset.from_list([{"problem": f"{prefix}{i}", "answer": str(i)} for i in range(n)])

    single = tmp_path / "single"
    rows("s", 6).save_to_disk(str(single))
    assert load_rows(str(single))["problem"] == [f"s{i}" for i in range(6)]
    assert load_rows(str(single), split="test")["problem"] == [f"s{i}" for i in range(6)]
    spec = RunSpec(data=str(single), num_prompts=4, prompts_per_step=4, eval_num_prompts=3)
    assert build_dataset(spec)["problem"] == ["s0", "s1", "s2", "s3"]
    assert eval_rows(spec)["problem"] == ["s4", "s5"]  # never its training rows
    saved_dict = tmp_path / "dict"
    datasets.DatasetDict({"train": rows("t", 3), "test": rows("x", 2)}).save_to_disk(str(saved_dict))
    assert load_rows(str(saved_dict))["problem"] == ["t0", "t1", "t2"]
    assert load_rows(str(saved_dict), split="test")["problem"] == ["x0", "x1"]
    assert data.load_benchmark(str(saved_dict))["problem"] == ["x0", "x1"]
    with pytest.raises(data.MissingSplit, match=r"dict: the local dataset folder, split 'validation' does not load "
                                                r".*\['test', 'train'\]"):
        load_rows(str(saved_dict), split="validation")


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_a_json_column_of_mixed_types_in_a_dataset_folder_is_read_as_its_values(tmp_path):
    """`datasets` keeps a JSON column whose rows mix types (AIME-like answers: 204, then '\\frac{1}{2}'; ids 0 and
    'x'), in a struct too, as a Json feature stored as JSON text: the gold answer is '\\frac{1}{2}', not the text
    '"\\\\frac{1}{2}"' that no reply scores, whether the folder is JSON lines or written by save_to_disk."""
    import datasets

    if not hasattr(datasets, "Json"):
        pytest.skip("this datasets refuses a column of mixed types")
    from sage_core.reward import score

    records = [{"problem": "p0", "answer": 204, "id": 0, "reward_model": {"ground_truth": 204}},
               {"problem": "p1", "answer": "\\frac{1}{2}", "id": "x", "reward_model": {"ground_truth": "\\frac{1}{2}"}}]
    folder = tmp_path / "jsonl"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    saved = tmp_path / "saved"
    datasets.load_dataset(str(folder), split="train").save_to_disk(str(saved))
    for source in (folder, saved):
        rows = load_rows(str(source))
        assert rows["answer"] == ["204", "\\frac{1}{2}"], source
        assert rows["prompt_id"] == ["0", "x"], source
        assert score("So \\boxed{\\frac{1}{2}}", rows["answer"][1]) == 1.0
        records_ = data.read_records(str(source), "train")[0]
        assert [r["reward_model"]["ground_truth"] for r in records_] == [204, "\\frac{1}{2}"], source


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_eval_rows_of_a_folder_with_only_a_train_split_are_its_rows_after_the_training_rows(tmp_path):
    """A local data set with only 'train' (Parquet files, or a saved DatasetDict) is held out as the same rows in
    one .parquet file are: the rows after the first num_prompts; none left is an error that counts the rows."""
    import datasets

    records = [{"problem": f"p{i}", "answer": str(i)} for i in range(12)]
    folder = tmp_path / "parquet"
    folder.mkdir()
    pd.DataFrame(records).to_parquet(folder / "train.parquet")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(saved))
    file = tmp_path / "rows.parquet"
    pd.DataFrame(records).to_parquet(file)
    for source in (folder, saved, file):
        spec = RunSpec(data=str(source), num_prompts=8, prompts_per_step=4, eval_num_prompts=3)
        assert build_dataset(spec)["problem"] == [f"p{i}" for i in range(8)], source
        assert eval_rows(spec)["problem"] == ["p8", "p9", "p10"], source
        with pytest.raises(data.DataError, match=r"no rows left for evaluation after the first 64 training rows: it "
                                                 r"has 12 rows, all of them within the first 64 \(num_prompts\)"):
            eval_rows(spec.model_copy(update={"num_prompts": 64}))


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_float32_answers_in_parquet_are_the_decimals_they_print_as(tmp_path):
    """A float32 0.1 read from Parquet is widened to 0.10000000149011612 by Python: the gold answer is '0.1', as
    the leak guard and the reward compare it, whether the column is float32, float16 or a float32 struct field."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "f32.parquet"
    pq.write_table(pa.table({
        "problem": ["a", "b", "c", "d"],
        "answer": pa.array([0.1, 2.5, 3.0, 1e-7], pa.float32()),
        "difficulty": pa.array([1, 2, 3, 4], pa.float32()),
        "half": pa.array(np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float16)),
    }), path)
    rows = load_rows(str(path))
    assert rows["answer"] == ["0.1", "2.5", "3", "1e-07"]
    assert rows["difficulty"] == [1, 2, 3, 4]
    assert [r["half"] for r in data.read_records(str(path), "train")[0]] == [0.1, 0.2, 0.3, 0.4]
    nested = tmp_path / "verl.parquet"
    gt = pa.array([{"ground_truth": 0.1}], pa.struct([("ground_truth", pa.float32())]))
    pq.write_table(pa.table({"problem": ["a"], "reward_model": gt}), nested)
    assert load_rows(str(nested))["answer"] == ["0.1"]
    for missing in (None, float("nan")):  # still a row without an answer
        pq.write_table(pa.table({"problem": ["a", "b"], "answer": pa.array([0.1, missing], pa.float32())}), path)
        with pytest.raises(data.DataError, match=r"row 1 has no 'answer'"):
            load_rows(str(path))


def test_gsm8k_answers_split_into_gold_answer_and_solution(tmp_path):
    """GSM8K's answer cell is the rationale (with <<...>> calculator notes) and then '#### answer': the gold answer
    is what follows ####, the rationale becomes the solution the hints are written from."""
    cell = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
            "in April and May.\n#### 72")
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Natalia sold clips to 48 of her friends in April ...", "answer": cell},
        {"question": "How many cents ...",
         "answer": "100 * 12 = <<100*12=1200>>1200 ... 1,234 - 1 = 1,233\n#### 1,233"},
        {"question": "Own solution", "answer": "First 2 + 2 = 4.\n#### 4", "solution": "Add two and two."},
    ]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every row has a solution now: no answer-free hints warning
        rows = load_rows(str(path))
    assert [r["answer"] for r in rows] == ["72", "1233", "4"]
    assert rows[0]["solution"] == ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in "
                                   "April and May.")
    assert rows[1]["solution"] == "100 * 12 = 1200 ... 1,234 - 1 = 1,233"
    assert rows[2]["solution"] == "Add two and two."  # a solution of its own is kept
    assert data.split_gsm8k("a plain answer") is None and data.split_gsm8k("x = 3 #### 4") is None


def test_math_rows_take_the_answer_from_the_solutions_last_box(tmp_path):
    """MATH's layout: problem, solution ending in \\boxed{answer}, level 'Level N', no answer column."""
    rows = [{"problem": "What is half of one?", "solution": "Half of $1$ is $\\boxed{\\frac{1}{2}}$.",
             "level": "Level 2", "type": "Algebra"},
            {"problem": "Twice 3?", "solution": "We get $\\boxed{3}$, no, $\\boxed{6}$.", "level": "Level ?"}]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    got = load_rows(str(path))
    assert [(r["answer"], r["difficulty"]) for r in got] == [("\\frac{1}{2}", 2), ("6", -1)]
    assert got[0]["solution"] == rows[0]["solution"]
    # MATH-500's layout: an answer column, an int level, unique_id
    path.write_text(json.dumps({"problem": "p", "solution": "s $\\boxed{2}$", "answer": "2", "level": 4,
                                "unique_id": "test/algebra/1.json"}))
    assert [(r["answer"], r["difficulty"], r["prompt_id"]) for r in load_rows(str(path))] == [
        ("2", 4, "test/algebra/1.json")]
    path.write_text("\n".join(json.dumps(r) for r in [rows[0], {"problem": "p", "solution": "no box here"}]))
    with pytest.raises(data.DataError, match=r"row 1 has no 'answer' column and its 'solution' has no \\boxed\{\}"):
        load_rows(str(path))
    path.write_text(json.dumps({"problem": "p", "solution": "no box"}))
    with pytest.raises(data.DataError, match=r"missing column 'answer' \(or .*a 'solution' that ends in"):
        load_rows(str(path))


def test_a_math_row_without_a_box_is_named_by_row_also_when_it_is_the_first(tmp_path):
    """MATH's layout (no answer column) is told by the solutions' boxes: a first solution without one is an error
    naming that row, as a later one is, not 'missing column answer' for a file whose other rows have theirs."""
    boxed, unboxed = {"problem": "p1", "solution": "\\boxed{3}"}, {"problem": "p0", "solution": "The answer is 5."}
    path = tmp_path / "math.jsonl"
    for bad, rows in enumerate(([unboxed, boxed], [boxed, unboxed])):
        path.write_text("\n".join(json.dumps(r) for r in rows))
        with pytest.raises(data.DataError, match=rf"math.jsonl: row {bad} has no 'answer' column and its 'solution' "
                                                 r"has no \\boxed\{\} answer: 'The answer is 5.'"):
            load_rows(str(path))


def test_a_dataset_of_several_configs_is_named_with_its_config(tmp_path):
    """openai/gsm8k has configs 'main' and 'socratic': NAME:CONFIG picks one (here a local folder laid out the same
    way, offline); without it, the error says how to name one."""
    folder = tmp_path / "gsm8k"
    for config, rationale in (("main", "2 + 2 = <<2+2=4>>4"), ("socratic", "How many? ** 2 + 2 = <<2+2=4>>4")):
        (folder / config).mkdir(parents=True)
        row = {"question": "2 + 2?", "answer": rationale + "\n#### 4"}
        (folder / config / "train.jsonl").write_text(json.dumps(row))
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: "
                                      "main/train.jsonl\n- config_name: socratic\n  data_files:\n  - split: train\n"
                                      "    path: socratic/train.jsonl\n---\n")
    (row,) = load_rows(f"{folder}:socratic")
    assert (row["answer"], row["solution"]) == ("4", "How many? ** 2 + 2 = 4")
    assert load_rows(f"{folder}:main")[0]["solution"] == "2 + 2 = 4"
    with pytest.raises(data.DataError, match=r"named NAME:CONFIG, e\.g\. openai/gsm8k:main"):
        load_rows(str(folder))
    with pytest.raises(data.DataError, match=r"gsm8k:nope"):
        load_rows(f"{folder}:nope")


def test_verl_rows_keep_answer_solution_and_index_under_their_nested_columns(tmp_path):
    """verl's layout (the paper's parquet): reward_model.{ground_truth, solution}, extra_info.index."""
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps({"problem": "What is 2 + 2?", "extra_info": {"index": 3},
                                "reward_model": {"ground_truth": "4", "solution": "2 + 2 = 4, so \\boxed{4}."}}))
    (row,) = load_rows(str(path))
    assert (row["answer"], row["solution"], row["prompt_id"]) == ("4", "2 + 2 = 4, so \\boxed{4}.", "3")


def test_verl_columns_flattened_to_dotted_names_are_read_as_the_nested_ones(tmp_path):
    """verl's layout flattened (datasets' Dataset.flatten, pandas' json_normalize): columns named
    'reward_model.ground_truth', 'reward_model.solution' and 'extra_info.index' are the nested columns."""
    import datasets

    nested = [{"prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "extra_info": {"index": i},
               "reward_model": {"ground_truth": str(i + 2), "solution": f"{i} + 2 = \\boxed{{{i + 2}}}"}}
              for i in range(2)]
    path = tmp_path / "flat.parquet"
    datasets.Dataset.from_list(nested).flatten().to_parquet(str(path))
    assert "reward_model.ground_truth" in data.read_records(str(path), "train")[0][0]
    rows = load_rows(str(path))
    assert rows["answer"] == ["2", "3"]
    assert rows["prompt_id"] == ["0", "1"]
    assert rows["solution"] == ["0 + 2 = \\boxed{2}", "1 + 2 = \\boxed{3}"]


def test_a_benchmark_data_set_is_read_from_its_test_split(tmp_path):
    """A benchmark folder or HF name is read from 'test', else 'validation', else 'train' (MATH-500 has only 'test',
    some AIME sets only 'train'); a run's held-out rows come from its training split only where the source has no
    other, and then only its rows after the training rows."""
    def folder(name, **splits):
        d = tmp_path / name
        d.mkdir()
        for split, answer in splits.items():
            (d / f"{split}.jsonl").write_text(json.dumps({"problem": f"{split} question", "answer": answer}))
        return d

    both = folder("both", train="1", test="2")
    only_train = folder("only_train", train="3")
    assert data.load_benchmark(str(both))[0]["answer"] == "2"
    assert data.load_benchmark(str(only_train))[0]["answer"] == "3"
    spec = RunSpec(data=str(only_train), num_prompts=1, prompts_per_step=1, eval_num_prompts=1)
    with pytest.raises(data.DataError, match=r"no rows left for evaluation after the first 1 training rows: it has "
                                             r"1 row, all of them within the first 1 \(num_prompts\)"):
        eval_rows(spec)
    assert eval_rows(spec.model_copy(update={"data": str(both)}))[0]["answer"] == "2"
    file = both / "test.jsonl"  # a file is read as it is
    assert data.load_benchmark(str(file))[0]["problem"] == "test question"
    bad = folder("bad", test="4")
    (bad / "test.jsonl").write_text(json.dumps({"problem": "no answer"}))
    with pytest.raises(data.DataError, match="missing column 'answer'"):  # not taken for a missing split
        data.load_benchmark(str(bad))


def test_the_eval_while_training_never_scores_training_rows_of_its_own_source(tmp_path, monkeypatch):
    """eval_data naming the training source itself (as a file, relative or absolute) takes that source's held-out
    rows, named `<data>-heldout`, never its first rows (the training rows); 'heldout' says so directly; 'synthetic'
    is the synthetic held-out set whatever the spec trains on; another file is its own first rows."""
    from sage_core.data import build_dataset, eval_rows, eval_set_name, eval_set_rows, synthetic_rows
    from sage_core.spec import RunSpec, with_absolute_paths

    rows = synthetic_rows(40, seed=3)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) + "\n"
                                              for r in rows))
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) + "\n"
                                                  for r in rows[:5]))
    monkeypatch.chdir(tmp_path)
    base = with_absolute_paths(RunSpec(data="d.jsonl", num_prompts=16, eval_num_prompts=8, eval_every=1))
    train = {r["problem"] for r in build_dataset(base)}
    held = [r["problem"] for r in eval_rows(base)]
    for source in (None, "heldout", "d.jsonl", str(tmp_path / "d.jsonl")):
        spec = with_absolute_paths(base.model_copy(update={"eval_data": source}))
        got = [r["problem"] for r in eval_set_rows(spec)]
        assert got == held and not set(got) & train and eval_set_name(spec) == "d-heldout", source
    synthetic = base.model_copy(update={"eval_data": "synthetic"})
    assert eval_set_name(synthetic) == "synthetic-heldout"
    assert {r["problem"] for r in eval_set_rows(synthetic)} == {
        r["problem"] for r in eval_rows(base.model_copy(update={"data": "synthetic"}))}
    other = with_absolute_paths(base.model_copy(update={"eval_data": "other.jsonl"}))
    assert eval_set_name(other) == "other" and [r["problem"] for r in eval_set_rows(other)] == [
        r["problem"] for r in rows[:5]]


def test_columns_named_in_other_case_are_read_as_the_known_ones():
    """AIME 2024 as published (Problem, Solution, Answer, ID) was refused as missing 'prompt'; a column already named
    as the known one wins over another case of it."""
    rows = data.normalise_records([{"ID": "2024-I-1", "Problem": "What is 200 + 4 ?", "Solution": "200 + 4 = 204 .",
                                    "Answer": 204}], "aime.jsonl")
    assert [(r["prompt_id"], r["problem"], r["answer"], r["solution"]) for r in rows] == [
        ("2024-I-1", "What is 200 + 4 ?", "204", "200 + 4 = 204 .")]
    both = data.normalise_records([{"problem": "What is 1 + 1 ?", "answer": 2, "Answer": "two"}], "both.jsonl")
    assert both[0]["answer"] == "2"


def test_rows_whose_answer_is_a_placeholder_are_left_out_with_one_warning(tmp_path):
    """NuminaMath-1.5 answers a proof problem 'proof' and one whose answer it did not find 'notfound': no gold answer
    to train or score on (the reward would teach the policy to box the word). Such rows are left out, one warning
    counting them; the rows left are named by their row in the file; a file of nothing else is a DataError."""
    records = [{"problem": "Prove that 2 is prime.", "solution": "It has no divisor but 1 and 2.", "answer": "proof"},
               {"problem": "Find x.", "solution": "x = \\boxed{3}", "answer": "3"},
               {"problem": "Find y.", "solution": "We cannot say.", "answer": "notfound"},
               {"problem": "Show it.", "solution": "Done.", "answer": "$\\boxed{proof}$"},
               {"problem": "Find z.", "solution": "z = \\boxed{5}", "answer": "5"}]
    path = tmp_path / "numina.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    with pytest.warns(UserWarning) as caught:
        rows = load_rows(str(path))
    assert [(r["problem"], r["answer"]) for r in rows] == [("Find x.", "3"), ("Find z.", "5")]
    (warning,) = [w for w in caught if "placeholder" in str(w.message)]
    assert re.search(r"3 of 5 rows are left out: their answer is a placeholder \(2 'proof', 1 'notfound'.*\(rows 0, "
                     r"2, 3\)", str(warning.message))
    with pytest.warns(UserWarning, match="3 of 5 rows are left out"):  # nor scored on
        assert [r["answer"] for r in data.load_benchmark(str(path))] == ["3", "5"]
    path.write_text("\n".join(json.dumps(r | {"id": "same"}) for r in records))  # the rows left named as in the file
    with pytest.raises(data.DataError, match=r"rows 1 and 4 share 'same'"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_rows(str(path))
    path.write_text("\n".join(json.dumps(records[i]) for i in (0, 2)))
    with pytest.raises(data.DataError, match=r"numina.jsonl: every one of its 2 rows has a placeholder for an answer"):
        load_rows(str(path))


def test_a_blank_answer_cell_takes_the_solutions_last_box(tmp_path, caplog):
    """A row whose answer cell is blank (empty, null, or no such key in its line) while its solution ends in a box
    has that box as its gold answer, as MATH's layout (no answer column) has; neither is a DataError naming the row."""
    records = [{"problem": "p0", "solution": "s", "answer": "1"},
               {"problem": "p1", "solution": "so $\\boxed{\\frac{1}{2}}$", "answer": " "},
               {"problem": "p2", "solution": "first \\boxed{3}, then \\boxed{4}", "answer": None},
               {"problem": "p3", "solution": "\\boxed{5}"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    with caplog.at_level("INFO", logger="sage_core.data"):
        rows = load_rows(str(path))
    assert rows["answer"] == ["1", "\\frac{1}{2}", "4", "5"]
    assert rows["solution"] == [r["solution"] for r in records]
    assert "3 rows have a blank answer: their gold answer is their solution's last \\boxed{}" in caplog.text
    verl = tmp_path / "verl.jsonl"  # verl's nested columns alike
    verl.write_text(json.dumps({"problem": "p", "reward_model": {"ground_truth": "", "solution": "\\boxed{7}"}}))
    assert load_rows(str(verl))["answer"] == ["7"]
    unboxed = {"problem": "p1", "solution": "no box", "answer": ""}
    path.write_text("\n".join(json.dumps(r) for r in [records[0], unboxed]))
    with pytest.raises(data.DataError, match=r"rows.jsonl: row 1 has no 'answer' .*or only a blank one, and no "
                                             r"'solution' with a \\boxed\{\} answer"):
        load_rows(str(path))


def test_a_json_file_of_splits_gives_the_split_asked_and_a_benchmark_its_test_split(tmp_path, caplog):
    """A .json file shaped {"train": [...], "test": [...]} is read as a data set's splits are: training takes its
    'train' split, a benchmark its 'test' split (else 'validation', else 'train'), saying which where it has several;
    a split it lacks is a MissingSplit naming those it has (it was read from 'train' whatever was asked, so a
    benchmark was scored on the training rows)."""
    def rows(name, n):
        return [{"problem": f"{name} question {i}", "answer": str(i), "solution": "s"} for i in range(n)]

    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": rows("train", 3), "test": rows("test", 2)}))
    with caplog.at_level("INFO", logger="sage_core.data"):
        bench = data.load_benchmark(str(path))
    assert bench["problem"] == ["test question 0", "test question 1"]
    assert "split 'test' of its splits ['train', 'test']" in caplog.text
    assert load_rows(str(path))["problem"] == [f"train question {i}" for i in range(3)]
    assert build_dataset(RunSpec(data=str(path), num_prompts=2))["problem"] == ["train question 0", "train question 1"]
    with pytest.raises(data.MissingSplit, match=r"splits.json: the JSON object has the splits \['train', 'test'\], "
                                                r"not 'validation'"):
        load_rows(str(path), split="validation")
    path.write_text(json.dumps({"train": rows("train", 1), "validation": rows("validation", 1)}))
    assert data.load_benchmark(str(path))["problem"] == ["validation question 0"]
    path.write_text(json.dumps({"train": rows("train", 1)}))  # only 'train' (some AIME sets): that one
    assert data.load_benchmark(str(path))["problem"] == ["train question 0"]
    path.write_text(json.dumps({"dev": rows("dev", 1)}))
    with pytest.raises(data.MissingSplit, match=r"no 'test' or 'validation' or 'train' split for evaluation .*the "
                                                r"splits \['dev'\]"):
        data.load_benchmark(str(path))
    path.write_text(json.dumps({"data": rows("data", 1)}))  # rows under 'data' (or a list): no splits, the rows
    assert data.load_benchmark(str(path))["problem"] == ["data question 0"]


def test_dapo_math_prompts_are_unwrapped_to_the_bare_problem(tmp_path):
    """DAPO-Math-17k's user turn wraps the problem in an instruction to end with a line 'Answer: ...', while the reward
    reads the last \\boxed{} and the system prompt asks for one: the policy is asked the bare problem. Only that exact
    wrapper is removed; other text around a problem stays."""
    wrapped = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is $1 + 1$?\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")
    dapo = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": wrapped}], "ability": "MATH",
            "reward_model": {"ground_truth": "2", "style": "rule-lapse"}, "extra_info": {"index": "a1"}}
    other = wrapped.replace('"Answer:".', '"Answer:", and you do not need to use a \\boxed command.')
    records = [dapo, {"prompt": [{"role": "user", "content": other}], "reward_model": {"ground_truth": "3"},
                      "extra_info": {"index": "a2"}},
               {"problem": wrapped.replace("1 + 1", "2 + 2"), "answer": "4", "id": "a3"}]
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    with pytest.warns(UserWarning, match="answer-free"):
        rows = load_rows(str(path), system_prompt=prompts.SYSTEM_PROMPT)
    assert rows[0]["prompt"] == prompts.chat("What is $1 + 1$?", prompts.SYSTEM_PROMPT)
    assert (rows[0]["problem"], rows[0]["answer"], rows[0]["prompt_id"]) == ("What is $1 + 1$?", "2", "a1")
    assert rows[1]["prompt"][-1]["content"] == rows[1]["problem"] == other  # not DAPO's wrapper: as it is
    assert rows[2]["prompt"] == prompts.chat("What is $2 + 2$?", prompts.SYSTEM_PROMPT)
    assert rows[2]["problem"] == "What is $2 + 2$?"


def test_held_out_rows_of_a_json_file_of_splits_are_its_test_split(tmp_path, caplog):
    """A .json file of splits trained on is held out as a data set with splits is: its 'test' split, else its
    'validation' split, named `<data>-heldout`, as the eval while training and the flows take it (it was its 'train'
    rows after the first num_prompts, though the file has a split set apart for evaluation); only a file with no other
    split takes its training rows after the first num_prompts. A file of rows is held out as before."""
    from sage_core.data import eval_set_name, eval_set_rows, heldout_name

    def rows(name, n):
        return [{"problem": f"{name} question {i}", "answer": str(i), "solution": "s", "id": f"{name}-{i}"}
                for i in range(n)]

    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": rows("train", 6), "test": rows("test", 3)}))
    spec = RunSpec(data=str(path), num_prompts=4, prompts_per_step=4, eval_num_prompts=2)
    assert build_dataset(spec)["problem"] == [f"train question {i}" for i in range(4)]
    with caplog.at_level("INFO", logger="sage_core.data"):
        held = eval_rows(spec)
    assert held["problem"] == ["test question 0", "test question 1"]
    assert held["prompt_id"] == ["test-0", "test-1"]
    assert "split 'test' of its splits ['train', 'test']" in caplog.text
    assert [r["problem"] for r in eval_set_rows(spec.model_copy(update={"eval_data": str(path)}))] == held["problem"]
    assert eval_set_name(spec) == heldout_name(spec) == "splits-heldout"
    assert eval_rows(spec.model_copy(update={"eval_num_prompts": 10}))["problem"] == [
        f"test question {i}" for i in range(3)]
    path.write_text(json.dumps({"validation": rows("validation", 1), "train": rows("train", 6)}))
    assert eval_rows(spec)["problem"] == ["validation question 0"]
    path.write_text(json.dumps({"train": rows("train", 6)}))  # no other split: the training rows after the first 4
    assert eval_rows(spec)["problem"] == ["train question 4", "train question 5"]
    path.write_text(json.dumps({"train": rows("train", 4), "dev": rows("dev", 2)}))
    with pytest.raises(data.DataError, match=r"splits.json: no rows left for evaluation after the first 4 training "
                                             r"rows: it has 4 rows"):
        eval_rows(spec)
    path.write_text(json.dumps(rows("rows", 6)))  # a file of rows: its rows after the training rows
    assert eval_rows(spec)["problem"] == ["rows question 4", "rows question 5"]
    path.write_text(json.dumps({"data": rows("data", 6)}))
    assert eval_rows(spec)["problem"] == ["data question 4", "data question 5"]
    # an empty split of several is named, with the rows the others have (it was "splits.json: no rows")
    path.write_text(json.dumps({"train": rows("train", 6), "test": []}))
    with pytest.raises(data.DataError, match=r"splits.json: split 'test' has no rows \(the JSON object's splits: "
                                             r"'train' 6, 'test' 0\)"):
        eval_rows(spec)
    path.write_text(json.dumps({"train": [], "test": rows("test", 3)}))
    with pytest.raises(data.DataError, match=r"split 'train' has no rows"):
        build_dataset(spec)


def test_simple_evals_math_prompts_are_unwrapped_to_the_bare_problem(tmp_path, caplog):
    """simple-evals' MATH template (openai/simple-evals math_eval.py) wraps the problem in an instruction to end with a
    line 'Answer: $ANSWER' and says no \\boxed command is needed, while the reward reads only the last \\boxed{}: the
    policy is asked the bare problem, with one info line counting them. Its exact text only (and its first version's,
    'ANSWER:' in both parts); other text around a problem, or the two versions' parts mixed, stays as it is."""
    wrapped = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $ANSWER (without quotes) where $ANSWER is the answer to the problem.\n\nWhat is $1 + 1$?\n\n"
               "Remember to put your answer on its own line after \"Answer:\", and you do not need to use a \\boxed "
               "command.")
    first_version = wrapped.replace("form Answer:", "form ANSWER:").replace('"Answer:"', '"ANSWER:"')
    records = [{"prompt": [{"role": "user", "content": wrapped}], "answer": "2", "solution": "s", "id": "a1"},
               {"Question": first_version.replace("1 + 1", "2 + 2"), "Answer": "4", "solution": "s", "id": "a2"},
               {"problem": wrapped.replace("1 + 1", "3 + 3") + " Show your work.", "answer": "6", "solution": "s",
                "id": "a3"},
               {"problem": wrapped.replace('"Answer:"', '"ANSWER:"').replace("1 + 1", "4 + 4"), "answer": "8",
                "solution": "s", "id": "a4"}]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    with caplog.at_level("INFO", logger="sage_core.data"):
        rows = load_rows(str(path), system_prompt=prompts.SYSTEM_PROMPT)
    assert rows[0]["prompt"] == prompts.chat("What is $1 + 1$?", prompts.SYSTEM_PROMPT)
    assert (rows[0]["problem"], rows[0]["answer"], rows[0]["prompt_id"]) == ("What is $1 + 1$?", "2", "a1")
    assert rows[1]["prompt"] == prompts.chat("What is $2 + 2$?", prompts.SYSTEM_PROMPT)
    assert rows[1]["problem"] == "What is $2 + 2$?"
    for row, record in zip(list(rows)[2:], records[2:], strict=True):  # not the exact wrapper: as it is
        assert row["prompt"][-1]["content"] == row["problem"] == record["problem"]
    assert "2 prompts are simple-evals' instruction to end with a line 'Answer: ...'" in caplog.text
    assert "DAPO" not in caplog.text
