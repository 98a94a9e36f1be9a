"""Data: the built-in synthetic arithmetic task and loading Parquet/JSONL/JSON/HF datasets into the row schema.

Row schema (docs/architecture.md): `prompt` (chat list), `problem`, `solution` ("" if none), `answer` (no \\boxed),
`prompt_id` (unique str), `difficulty` (int, -1 when unknown).

The synthetic task: a start value and 1..4 steps (+, -, * by small numbers), every intermediate value in 1..30,
words separated by spaces ("." and "?" are words too) so the tiny word-level tokenizer covers it exactly.
`difficulty` is the number of steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import prompts
from .reward import extract_boxed

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A data source that cannot be turned into rows; the message names the source and what is wrong with it."""


class MissingDataFile(DataError, FileNotFoundError):
    """A data file that does not exist."""


class PromptTooLong(DataError):
    """A prompt that does not fit the generation context (the trainer raises it on every process together)."""


class MissingSplit(DataError):
    """A data set (folder or HF name) without the split asked for."""

# ----------------------------------------------------------------------------------------------------------------
# Synthetic task
# ----------------------------------------------------------------------------------------------------------------

FEMALE_NAMES = ("Ann", "Mia", "Eva", "Lily", "Zoe", "Kate", "Amy", "Sue")
MALE_NAMES = ("Bob", "Tom", "Sam", "Ben", "Max", "Leo", "Dan", "Jim")
OBJECTS = ("coins", "apples", "books", "cards", "pens", "stamps", "shells", "marbles", "cookies", "stickers",
           "eggs", "toys")
# {P}: the pronoun starting a sentence ("She"/"He"), {n}: the operand.
STEP_TEMPLATES = {
    "+": ("{P} gets {n} more .", "{P} finds {n} more .", "{P} buys {n} more .", "{P} wins {n} more ."),
    "-": ("{P} gives away {n} .", "{P} loses {n} .", "{P} sells {n} .", "{P} uses {n} ."),
    "*": ("{P} now has {n} times as many .", "{P} ends up with {n} times as many ."),
}
OPENING = "{name} has {start} {obj} ."
QUESTION = "How many {obj} does {name} have now ?"
ANSWER_SENTENCE = "The answer is \\boxed{{{answer}}} ."

MAX_VALUE = 30          # every intermediate value stays in 1..MAX_VALUE
START_RANGE = (2, 15)
OPERAND_RANGE = (1, 5)  # + and - operands (small: a tiny model learns these facts in a minute or two)
MUL_OPERANDS = (2, 3)
OP_WEIGHTS = {"+": 0.4, "-": 0.4, "*": 0.2}

Difficulty = str  # "mixed" | "easy" | "hard"
_STEP_RE = re.compile(r"(\d+) ([+\-*]) (\d+) = (\d+)")


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _sample_steps(rng: random.Random, n_steps: int) -> tuple[int, list[tuple[str, int, int, int]]]:
    """(start, [(op, lhs, operand, result), ...]) with every value in 1..MAX_VALUE and an answer that differs from
    every other number of the problem and of its reference hints (so reference hints never contain the answer)."""
    while True:
        start = rng.randint(*START_RANGE)
        value, steps = start, []
        for _ in range(n_steps):
            options: dict[str, list[int]] = {
                "+": [n for n in range(OPERAND_RANGE[0], OPERAND_RANGE[1] + 1) if value + n <= MAX_VALUE],
                "-": [n for n in range(OPERAND_RANGE[0], OPERAND_RANGE[1] + 1) if value - n >= 1],
                "*": [n for n in MUL_OPERANDS if value >= 2 and value * n <= MAX_VALUE],
            }
            ops = [op for op, ns in options.items() if ns]
            op = rng.choices(ops, weights=[OP_WEIGHTS[o] for o in ops])[0]
            n = rng.choice(options[op])
            new = _apply(op, value, n)
            steps.append((op, value, n, new))
            value = new
        others = {start} | {s[2] for s in steps} | {s[3] for s in steps[:-1]}
        if value not in others:
            return start, steps


def _steps_for(rng: random.Random, difficulty: Difficulty) -> int:
    if difficulty == "easy":
        return 1
    if difficulty == "hard":
        return rng.randint(3, 4)
    if difficulty == "mixed":
        return rng.randint(1, 4)
    raise ValueError(f"difficulty must be 'mixed', 'easy' or 'hard', got {difficulty!r}")


def _step_text(step: tuple[str, int, int, int], with_result: bool = True) -> str:
    op, a, n, r = step
    return f"{a} {op} {n} = {r}" if with_result else f"{a} {op} {n}"


def make_problem(rng: random.Random, n_steps: int) -> dict[str, Any]:
    """One synthetic problem: problem text, step-by-step solution, answer, difficulty."""
    female = rng.random() < 0.5
    name = rng.choice(FEMALE_NAMES if female else MALE_NAMES)
    pronoun = "She" if female else "He"
    obj = rng.choice(OBJECTS)
    start, steps = _sample_steps(rng, n_steps)
    sentences = [OPENING.format(name=name, start=start, obj=obj)]
    for op, _, n, _ in steps:
        sentences.append(rng.choice(STEP_TEMPLATES[op]).format(P=pronoun, n=n))
    sentences.append(QUESTION.format(obj=obj, name=name))
    answer = str(steps[-1][3])
    solution = " ".join(_step_text(s) + " ." for s in steps) + " " + ANSWER_SENTENCE.format(answer=answer)
    return {"problem": " ".join(sentences), "solution": solution, "answer": answer, "difficulty": n_steps}


def synthetic_rows(n: int, seed: int = 0, difficulty: Difficulty = "mixed",
                   system_prompt: str | None = None) -> list[dict[str, Any]]:
    """`n` synthetic rows in the row schema. mixed: steps uniform in 1..4; easy: 1 step; hard: 3..4 steps.
    Deterministic in (n, seed, difficulty); `prompt_id` is f"syn-{seed}-{i}" (row i of that seed)."""
    rng = random.Random(f"sage-synthetic-{seed}-{difficulty}")
    rows = []
    for i in range(n):
        row = make_problem(rng, _steps_for(rng, difficulty))
        rows.append({"prompt": prompts.chat(row["problem"], system_prompt), "problem": row["problem"],
                     "solution": row["solution"], "answer": row["answer"], "prompt_id": f"syn-{seed}-{i}",
                     "difficulty": row["difficulty"]})
    return rows


def parse_steps(solution: str) -> list[tuple[str, int, int, int]]:
    """The worked steps `a op n = r` of a synthetic-format solution ([] when it has none)."""
    return [(op, int(a), int(n), int(r)) for a, op, n, r in _STEP_RE.findall(solution or "")]


def reference_hint(row: Mapping[str, Any], level: int) -> str:
    """The reference hint of `row` at `level` (what the tiny model learns to write):

    - level 1: the plan, no numbers:            "Use + then - ."
    - level 2: the first step worked:           "First 7 + 5 = 12 ."  (one-step problems: "First 7 + 5 ." with no
      result, since the first result is the answer)
    - level 3: every step but the last result:  "7 + 5 = 12 . Then 12 - 3 ."

    Synthetic rows never contain their answer in a hint: the generator rejects problems whose answer equals the start
    value, an operand or an intermediate result. A synthetic-format solution from elsewhere can contain such a
    coincidence (e.g. 5 + 3 = 8 . 8 - 3 = 5); the hint is then left as is and the leak guard (sage_core.hints)
    rejects it. Solutions in another format get a generic hint: their sentences with the final one dropped
    (level 1: the first sentence, level 2: the first half, level 3: all but the last), dropping every sentence that
    contains the answer or a \\boxed{}. An empty solution gives "" (the hint source then uses its answer-free path).
    """
    if level not in prompts.LEVELS:
        raise ValueError(f"hint level must be one of {prompts.LEVELS}, got {level!r}")
    solution = str(row.get("solution") or "")
    steps = parse_steps(solution)
    if steps:
        if level == 1:
            return "Use " + " then ".join(s[0] for s in steps) + " ."
        if level == 2:
            return "First " + _step_text(steps[0], with_result=len(steps) > 1) + " ."
        worked = [_step_text(s) + " ." for s in steps[:-1]]
        return " ".join(worked + ["Then " + _step_text(steps[-1], with_result=False) + " ."])
    return _generic_hint(solution, str(row.get("answer") or ""), level)


def _generic_hint(solution: str, answer: str, level: int) -> str:
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", solution) if s.strip()]
    if len(sentences) > 1:
        sentences = sentences[:-1]  # the last sentence usually states the result
    ans = re.escape(answer.strip()) if answer.strip() else None
    keep = [s for s in sentences if "\\boxed" not in s
            and not (ans and re.search(rf"(?<![\w.]){ans}(?![\w]|\.\d)", s))]
    if not keep:
        return ""
    n = {1: 1, 2: max(1, len(keep) // 2), 3: len(keep)}[level]
    return " ".join(keep[:n])


# ----------------------------------------------------------------------------------------------------------------
# Loading and normalising external data
# ----------------------------------------------------------------------------------------------------------------

ANSWER_ALIASES = ("answer", "gt", "ground_truth", "final_answer")
PROBLEM_ALIASES = ("problem", "question")
ID_ALIASES = ("prompt_id", "id", "index", "unique_id")
# answers that say there is none to check: NuminaMath-1.5 gives a proof problem the answer 'proof' and a problem whose
# answer it could not find in the solution 'notfound'; trained on, the reward would teach a policy to box the word
PLACEHOLDER_ANSWERS = ("proof", "notfound")


# DAPO-Math-17k's user turn: its problem inside an instruction to end the reply with a line 'Answer: ...'
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


# simple-evals' MATH prompt (openai/simple-evals math_eval.py, QUERY_TEMPLATE): the problem inside an instruction to
# end with a line 'Answer: ...' and not to box it; its first version wrote ANSWER for Answer in both parts
SIMPLE_EVALS_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the "
                       "form Answer: $ANSWER (without quotes) where $ANSWER is the answer to the problem.\n\n")
SIMPLE_EVALS_SUFFIX = ('\n\nRemember to put your answer on its own line after "Answer:", and you do not need to use a '
                       '\\boxed command.')
SIMPLE_EVALS_WRAPPERS = ((SIMPLE_EVALS_PREFIX, SIMPLE_EVALS_SUFFIX),
                         (SIMPLE_EVALS_PREFIX.replace("form Answer:", "form ANSWER:"),
                          SIMPLE_EVALS_SUFFIX.replace('"Answer:"', '"ANSWER:"')))


def unwrap_dapo(text: str) -> str:
    """The bare problem of a prompt that is DAPO-Math-17k's instruction wrapper around it (DAPO_PREFIX, the problem,
    DAPO_SUFFIX, exactly); any other text as it is. The wrapper asks for a last line 'Answer: ...', while the reward
    (sage_core.reward) reads the reply's last \\boxed{} and the system prompt (prompts.SYSTEM_PROMPT) asks for one:
    kept, it told the policy two formats at once, and replies that followed the wrapper scored 0."""
    return _unwrap(text, ((DAPO_PREFIX, DAPO_SUFFIX),))


def unwrap_simple_evals(text: str) -> str:
    """The bare problem of a prompt that is simple-evals' MATH template around it (SIMPLE_EVALS_PREFIX, the problem,
    SIMPLE_EVALS_SUFFIX, exactly, or its first version's, SIMPLE_EVALS_WRAPPERS); any other text as it is. As DAPO's
    (unwrap_dapo), it asks for a last line 'Answer: ...', and also says no \\boxed{} is needed, while the reward reads
    only the reply's last \\boxed{}: replies that followed it scored 0."""
    return _unwrap(text, SIMPLE_EVALS_WRAPPERS)


def _unwrap(text: str, wrappers: Iterable[tuple[str, str]]) -> str:
    """The text between the prefix and suffix of the first of `wrappers` that `text` starts and ends with exactly,
    where some is left; else `text` as it is."""
    for prefix, suffix in wrappers:
        if text.startswith(prefix) and text.endswith(suffix):
            problem = text[len(prefix):len(text) - len(suffix)].strip()
            if problem:
                return problem
    return text


def strip_boxed(answer: str) -> str:
    """'\\boxed{9}' -> '9' (only when the whole string is one box); anything else unchanged (stripped)."""
    s = answer.strip().strip("$").strip()
    m = re.fullmatch(r"\\boxed\s*\{(.*)\}", s, flags=re.S)
    if m:
        inner, depth = m.group(1), 0
        for ch in inner:  # only strip when the braces of the box enclose the whole string
            depth += (ch == "{") - (ch == "}")
            if depth < 0:
                return s
        return inner.strip() if depth == 0 else s
    return s


def split_gsm8k(answer: str) -> tuple[str, str] | None:
    """GSM8K's answer cell, 'rationale with <<48/2=24>> calculator notes\\n#### 72', as (answer, rationale): the
    answer is what follows the last ####, thousands separators dropped from a number (1,234 -> 1234); the rationale
    loses the calculator notes. None where the cell has no '#### ' line."""
    m = re.search(r"(?:^|\n)####\s*([^\n]*)\s*$", answer)
    if m is None:
        return None
    gold = m.group(1).strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", gold):
        gold = gold.replace(",", "")
    rationale = re.sub(r"<<[^<>]*>>", "", answer[:m.start()]).strip()
    return gold, rationale


def _to_py(v: Any) -> Any:
    """numpy arrays / pyarrow scalars (from Parquet via pandas) to plain Python."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()
    if isinstance(v, Mapping):
        return {k: _to_py(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_py(x) for x in v]
    return v


def _is_blank(v: Any) -> bool:
    """None, NaN, or a string of whitespace only: a cell with no value in it."""
    return _is_missing(v) or (isinstance(v, str) and not v.strip())


def _is_missing(v: Any) -> bool:
    if v is None:
        return True
    try:
        return v != v  # NaN
    except Exception:
        return False


def read_records(source: str, split: str) -> tuple[list[dict[str, Any]], str]:
    """Records of a .parquet/.jsonl/.json file, a local dataset dir or an HF dataset name, and a display name.

    A folder written by `datasets`' save_to_disk is read with load_from_disk: a saved DatasetDict gives its `split`
    (a MissingSplit naming the splits it has where it lacks it); a saved single Dataset has no splits, so it is the
    data whatever `split` is asked for. A .json file is alike: a JSON object of lists ({"train": [...], "test":
    [...]}) gives its `split` (a MissingSplit naming its splits where it lacks it), a list (or one under 'data' or
    'rows') is the data whatever `split` is asked for. Float32/float16 values (Parquet, Arrow) are read as the
    shortest decimal that is the same number in their own precision (a float32 0.1 is 0.1, not 0.10000000149011612)."""
    path = Path(source).expanduser()
    if _is_data_file(path):
        content, name = _read_data_file(path)
        return _split_rows(content, split, name), name
    import datasets
    import datasets.exceptions

    # a local dataset folder or an HF dataset name (the latter needs the network unless cached), either one with
    # ":config" for a data set of several configurations (openai/gsm8k:main)
    name, config = source, None
    if not path.exists() and ":" in source:
        name, config = source.rsplit(":", 1)
        path = Path(name).expanduser()
    if config is None and _saved_to_disk(path) is not None:
        return _records_of(_load_from_disk(path, source, split)), str(path.resolve())
    try:
        ds = datasets.load_dataset(str(path) if path.is_dir() else name, config or None, split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:  # no such name, offline, no such split
        what = ("the local dataset folder" if path.is_dir()
                else "no such local file or folder; as a Hugging Face dataset")
        hint = (" (a data set of several configurations is named NAME:CONFIG, e.g. openai/gsm8k:main)"
                if config is None and "config" in str(e).lower() else "")
        # datasets says "Unknown split" in a plain ValueError: the words are all there is to tell it by
        error = MissingSplit if "unknown split" in str(e).lower() else DataError
        raise error(f"{source}: {what}, split {split!r} does not load ({e.__class__.__name__}: {e}){hint}") from e
    return _records_of(ds), (str(path.resolve()) + (f":{config}" if config else "") if path.is_dir() else source)


def _is_data_file(path: Path) -> bool:
    """Whether read_records reads `path` as a data file (a .parquet/.jsonl/.json name, or any file), not a data set."""
    return path.suffix.lower() in (".parquet", ".jsonl", ".json") or path.is_file()


def _read_data_file(path: Path) -> tuple[list[Any] | Mapping[str, Any], str]:
    """What a data file holds, and its name (its absolute path): its records, or the JSON object of a .json file
    (splits, or rows under 'data' or 'rows'), for _split_rows to pick from and check."""
    suffix = path.suffix.lower()
    if not path.exists():
        raise MissingDataFile(f"data file not found: {path.resolve()}")
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return _shortest_floats(pq.read_table(path)).to_pylist(), str(path.resolve())
        except pa.ArrowException as e:
            raise DataError(f"{path.resolve()}: not a readable Parquet file ({e})") from e
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte order mark (Windows' editors write one) is dropped
    except UnicodeDecodeError as e:
        raise DataError(f"{path.resolve()}: not UTF-8 text ({e})") from e
    except OSError as e:  # a folder named *.jsonl, no permission
        raise DataError(f"{path.resolve()}: cannot be read as a data file ({e.strerror})") from e
    if suffix == ".jsonl" or (suffix != ".json" and not text.lstrip().startswith(("[", "{\""))):
        try:
            return _json_lines(text, path.resolve()), str(path.resolve())
        except DataError as e:
            if suffix == ".jsonl":
                raise
            raise DataError(f"{e} (a '{suffix or 'no extension'}' file is read as JSON lines; data files are "
                            f".parquet, .jsonl or .json)") from e
    try:
        return json.loads(text), str(path.resolve())
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines in a .json file, as datasets' to_json writes by default
            return _json_lines(text, path.resolve()), str(path.resolve())
        raise DataError(f"{path.resolve()}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e


def _split_rows(data: Any, split: str, name: str) -> list[dict[str, Any]]:
    """The records of split `split` of what a data file holds (_read_data_file): a JSON object's list under `split`,
    else under 'data' or 'rows' (a MissingSplit naming its splits where it has others), a list as it is; each one
    an object with columns."""
    if isinstance(data, Mapping):  # {"train": [...], "test": [...]}: splits, as a DatasetDict's
        splits = _json_splits(data)
        for key in (split, "data", "rows"):
            if isinstance(data.get(key), list):
                if len(splits) > 1:
                    if not data[key]:  # else normalise_records' bare "no rows", while the file has rows
                        raise DataError(f"{name}: split {key!r} has no rows (the JSON object's splits: "
                                        + ", ".join(f"{s!r} {len(data[s])}" for s in splits) + ")")
                    logger.info("%s: split %r of its splits %s", name, key, splits)
                data = data[key]
                break
        else:
            if splits:  # not 'train' whatever split is asked: a benchmark was scored on its training rows
                raise MissingSplit(f"{name}: the JSON object has the splits {splits}, not {split!r}")
            raise DataError(f"{name}: a JSON object needs a list under '{split}', 'data' or 'rows'")
    if not isinstance(data, list):
        raise DataError(f"{name}: expected a list of records")
    for i, record in enumerate(data):  # as _json_lines checks each line: a row is an object with columns
        if not isinstance(record, Mapping):
            raise DataError(f"{name}: row {i} is a JSON {_json_type(record)}, not an object with columns")
    return data


def _json_splits(data: Any) -> list[str]:
    """The splits of what a data file holds (_read_data_file): a JSON object's keys whose values are lists; [] for
    a list of records."""
    return [k for k, v in data.items() if isinstance(v, list)] if isinstance(data, Mapping) else []


def _saved_to_disk(path: Path) -> str | None:
    """What save_to_disk wrote in folder `path`: "dict" (a DatasetDict: dataset_dict.json), "dataset" (a single
    Dataset: state.json beside its .arrow files), else None."""
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file():
        return "dict"
    return "dataset" if (path / "state.json").is_file() and any(path.glob("*.arrow")) else None


def _load_from_disk(path: Path, source: str, split: str):
    """The Dataset of a save_to_disk folder: a DatasetDict's `split`, a single Dataset whatever `split` is."""
    import datasets
    import datasets.exceptions

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise DataError(f"{source}: the dataset folder written by save_to_disk does not load "
                        f"({e.__class__.__name__}: {e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise MissingSplit(f"{source}: the local dataset folder, split {split!r} does not load (it has the "
                               f"splits {sorted(ds)})")
        ds = ds[split]
    return ds


def _records_of(ds: Any) -> list[dict[str, Any]]:
    """The rows of a `datasets.Dataset` as dicts, float32/float16 values as in _shortest_floats. A column of JSON
    whose rows mix types (answers 72 and "\\frac{1}{2}") is a Json feature, stored as JSON text: its values are
    decoded, as `datasets`' Python format decodes them (Arrow gives the text, '"\\\\frac{1}{2}"')."""
    from datasets.features.features import decode_nested_example

    rows = _shortest_floats(ds.with_format("arrow")[:]).to_pylist()
    for column in [c for c, feature in ds.features.items() if _has_json(feature)]:
        for r in rows:
            r[column] = decode_nested_example(ds.features[column], r[column])
    return rows


def _has_json(feature: Any) -> bool:
    """Whether a `datasets` feature is, or holds (in a struct or a list), a Json feature."""
    if isinstance(feature, Mapping):
        return any(_has_json(f) for f in feature.values())
    if isinstance(feature, (list, tuple)):
        return bool(feature) and _has_json(feature[0])
    if hasattr(feature, "feature"):  # List, LargeList
        return _has_json(feature.feature)
    return type(feature).__name__ == "Json"


def _shortest_floats(table: Any) -> Any:
    """`table` (a pyarrow Table) with its float32/float16 columns, struct fields among them, as float64 columns of
    the shortest decimals that are the same numbers in their own precision: to_pylist would widen a float32 0.1 to
    0.10000000149011612, an answer no reply states. Nulls and NaN stay missing."""
    import numpy
    import pyarrow as pa

    narrow = {pa.float16(): numpy.float16, pa.float32(): numpy.float32}

    def has_narrow(t: Any) -> bool:
        return t in narrow or (pa.types.is_struct(t) and any(has_narrow(f.type) for f in t))

    def convert(arr: Any) -> Any:
        if arr.type in narrow:
            cast = narrow[arr.type]
            return pa.array([None if v is None else float(str(cast(v))) for v in arr.to_pylist()], pa.float64())
        if pa.types.is_struct(arr.type) and has_narrow(arr.type):
            return pa.StructArray.from_arrays([convert(c) for c in arr.flatten()], names=[f.name for f in arr.type],
                                              mask=arr.is_null() if arr.null_count else None)
        return arr

    for i, field in enumerate(table.schema):
        if has_narrow(field.type):
            column = table.column(i)
            chunks = [convert(c) for c in column.chunks]
            new_type = chunks[0].type if chunks else convert(pa.array([], field.type)).type
            table = table.set_column(i, field.name, pa.chunked_array(chunks, new_type))
    return table


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type (null, boolean, number, string, array)."""
    return ("null" if value is None else "boolean" if isinstance(value, bool) else "number"
            if isinstance(value, (int, float)) else "string" if isinstance(value, str) else "array"
            if isinstance(value, list) else type(value).__name__)


def _json_lines(text: str, path: Path | str) -> list[dict[str, Any]]:
    """One JSON object per non-blank line; the first bad line is named (1-based) with what it starts with."""
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg} at column {e.colno}): "
                            f"{line.strip()[:80]!r}") from e
        if not isinstance(record, Mapping):
            raise DataError(f"{path}: line {lineno} is a JSON {type(record).__name__}, not an object with columns")
        records.append(record)
    return records


def _get_nested(record: Mapping[str, Any], dotted: str) -> Any:
    """record["a"]["b"] for "a.b", or a column named "a.b" itself: verl's nested columns flattened (datasets'
    Dataset.flatten, pandas' json_normalize)."""
    if dotted in record:
        return record[dotted]
    cur: Any = record
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI-style parts [{"type": "text", "text": ...}] joined by new
    lines (as vLLM's chat renderer joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, Mapping) and p.get("type") == "text"
                                                     and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise TypeError(f"message content must be text, got {content!r}"[:120])


def _normalise_prompt(prompt: Any, system_prompt: str | None) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return prompts.chat(prompt, system_prompt)
    msgs = [{"role": str(m["role"]), "content": _content_text(m["content"])} for m in prompt]
    if system_prompt and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


KNOWN_COLUMNS = frozenset({"prompt", "solution", "difficulty", *PROBLEM_ALIASES, *ANSWER_ALIASES, *ID_ALIASES})


def _known_names_lowered(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with a column named as a known one in other case (AIME 2024's `Problem`, `Answer`, `ID`) under the
    known name, where the record has no column of that name already."""
    for key in list(record):
        low = key.lower() if isinstance(key, str) else key
        if low != key and low in KNOWN_COLUMNS and low not in record:
            record[low] = record.pop(key)
    return record


def normalise_records(records: list[dict[str, Any]], source: str = "<records>",
                      system_prompt: str | None = None, first_row: int = 0,
                      for_hints: bool = True) -> list[dict[str, Any]]:
    """Records with any of the accepted column names -> rows in the schema. Raises DataError (a ValueError) on
    missing columns (naming the column, the source and the columns found), malformed prompts and duplicated prompt
    ids; rows are counted from `first_row` (0; the held-out rows of a file: their row in it). Rows without a
    solution are warned about where they are trained on (`for_hints`: hints are written from it), not in evaluation.
    Rows whose answer is a placeholder (PLACEHOLDER_ANSWERS: NuminaMath-1.5's 'proof', 'notfound') are left out,
    with one warning counting them; a DataError where every row is one. They are left out of the records given, so
    a file's first num_prompts rows train on fewer where some are (its held-out rows stay the rows after those)."""
    records = [_known_names_lowered(_to_py(dict(r))) for r in records]
    columns = sorted({k for r in records for k in r})
    if not records:
        raise DataError(f"{source}: no rows")

    def first(r: Mapping[str, Any], names: Iterable[str]) -> Any:
        for name in names:
            v = _get_nested(r, name)
            if not _is_blank(v):
                return v
        return None

    has_prompt = any(c in columns for c in ("prompt", *PROBLEM_ALIASES))
    if not has_prompt:
        raise DataError(f"{source}: missing column 'prompt' (or 'problem'/'question'); columns found: {columns}")
    answer_cols = (*ANSWER_ALIASES, "reward_model.ground_truth")
    boxed_in_solution = False  # MATH's layout: no answer column, the answer is the solution's last \boxed{}
    if not any(c in columns for c in ANSWER_ALIASES) and _get_nested(records[0], "reward_model.ground_truth") is None:
        # any row's box: a first row without one is that row's error (named below), not a file without answers
        if not any(extract_boxed(str(r.get("solution") or "")) is not None for r in records):
            raise DataError(f"{source}: missing column 'answer' (or {', '.join(ANSWER_ALIASES[1:])}, or a 'solution' "
                             f"that ends in \\boxed{{answer}}); columns found: {columns}")
        boxed_in_solution = True
    rows, at, no_solution, gsm8k, blank_boxed = [], [], 0, 0, 0
    wrapped = {"dapo": 0, "simple-evals": 0}  # prompts asked as their bare problem, by the wrapper removed
    placeholders: dict[str, list[int]] = {}  # placeholder answer -> the rows left out for it
    for i, r in enumerate(records, first_row):
        prompt = r.get("prompt")
        problem = first(r, PROBLEM_ALIASES)
        has_problem = problem is not None
        if _is_blank(prompt) or (isinstance(prompt, list) and not prompt):
            if problem is None:
                raise DataError(f"{source}: row {i} has no 'prompt' (or 'problem'/'question'), or only a blank one; "
                                 f"columns found: {columns}")
            prompt = str(problem)
        try:
            chat = _normalise_prompt(prompt, system_prompt)
        except (KeyError, TypeError) as e:
            raise DataError(f"{source}: row {i}: 'prompt' must be a string or a list of {{role, content}} messages, "
                            f"got {str(prompt)[:80]!r}") from e
        for wrapper, unwrap in (("dapo", unwrap_dapo), ("simple-evals", unwrap_simple_evals)):
            unwrapped = [{**m, "content": unwrap(m["content"])} if m["role"] == "user" else m for m in chat]
            if has_problem and isinstance(problem, str):
                problem = unwrap(problem)
            if unwrapped != chat:
                wrapped[wrapper], chat = wrapped[wrapper] + 1, unwrapped
        users = [m["content"] for m in chat if m["role"] == "user"]
        if problem is None:
            if not users:
                raise DataError(f"{source}: row {i}: the prompt has no user turn")
            problem = users[-1]
        if users and not users[-1].strip():  # as a blank string prompt: no question to ask (nor to hint)
            raise DataError(f"{source}: row {i}: the prompt's last user turn is blank: there is no question in it")
        solution = first(r, ("solution", "reward_model.solution"))
        if boxed_in_solution:
            answer = extract_boxed(str(solution or ""))
            if answer is None:
                raise DataError(f"{source}: row {i} has no 'answer' column and its 'solution' has no \\boxed{{}} "
                                f"answer: {str(solution)[-80:]!r}")
        else:
            answer = first(r, answer_cols)
            # a blank cell in an answer column: the solution's last box, as for a file without one (MATH's layout)
            if answer is None and (answer := extract_boxed(str(solution or ""))) is not None:
                blank_boxed += 1
        if answer is None:
            raise DataError(f"{source}: row {i} has no 'answer' (or {', '.join(ANSWER_ALIASES[1:])}), or only a "
                            f"blank one, and no 'solution' with a \\boxed{{}} answer; columns found: {columns}")
        if isinstance(answer, (Mapping, list)):
            raise DataError(f"{source}: row {i}: 'answer' must be a string or a number, got a "
                            f"{type(answer).__name__}: {str(answer)[:80]!r}")
        if isinstance(answer, float) and answer.is_integer():
            answer = int(answer)
        if isinstance(answer, str) and (split := split_gsm8k(answer)) is not None:
            answer, rationale = split
            gsm8k += 1
            if _is_missing(solution) or not str(solution).strip():
                solution = rationale
        gold = strip_boxed(str(answer))
        if not gold:
            raise DataError(f"{source}: row {i}: 'answer' {str(answer)[:80]!r} is empty once stripped of $ and "
                            f"\\boxed{{}}")
        if gold.lower() in PLACEHOLDER_ANSWERS:
            placeholders.setdefault(gold.lower(), []).append(i)
            continue
        if _is_missing(solution) or not str(solution).strip():
            no_solution += 1
            solution = ""
        pid = first(r, (*ID_ALIASES, "extra_info.index"))
        fields = {"problem": str(problem), "prompt": "".join(m["content"] for m in chat), "solution": str(solution),
                  "answer": gold, "prompt_id": "" if pid is None else str(pid)}
        if not has_problem:  # the problem is the prompt's user turn: the prompt is what to name
            fields.pop("problem")
        for name, text in fields.items():  # pyarrow, hashlib and tokenizers refuse them, deep down, naming no row
            if (bad := _lone_surrogate(text)) is not None:
                raise DataError(f"{source}: row {i}: its '{name}' is not valid Unicode text: it holds a lone "
                                f"surrogate ({bad}), as a JSON string cut inside an emoji's \\uXXXX pair does")
        if pid is None:
            pid = "h-" + hashlib.sha1(str(problem).encode()).hexdigest()[:12]
        diff = r.get("difficulty")
        if _is_missing(diff) and isinstance(r.get("level"), str):  # MATH: "Level 3"
            diff = (re.fullmatch(r"\s*Level\s+(\d+)\s*", r["level"]) or [None, None])[1]
        elif _is_missing(diff) and isinstance(r.get("level"), int):  # MATH-500: 3
            diff = r["level"]
        try:
            diff = int(diff) if not _is_missing(diff) else -1
        except (TypeError, ValueError):
            diff = -1
        rows.append({"prompt": chat, "problem": str(problem), "solution": str(solution),
                     "answer": gold, "prompt_id": str(pid), "difficulty": diff})
        at.append(i)
    if placeholders:
        n, where = sum(map(len, placeholders.values())), sorted(j for js in placeholders.values() for j in js)
        what = ", ".join(f"{len(js)} {a!r}" for a, js in placeholders.items())
        if not rows:
            raise DataError(f"{source}: every one of its {n} rows has a placeholder for an answer ({what}: "
                            "NuminaMath-1.5's marks of a proof or of an answer not found), no answer a reply can be "
                            "checked against")
        msg = (f"{source}: {n} of {n + len(rows)} rows are left out: their answer is a placeholder ({what}: "
               f"NuminaMath-1.5's marks of a proof or of an answer not found), no answer a reply can be checked "
               f"against (rows {', '.join(map(str, where[:5]))}{', ...' if n > 5 else ''})")
        logger.warning(msg)
        warnings.warn(msg, stacklevel=3)
    if gsm8k:
        logger.info("%s: %d of %d answers in GSM8K's form (rationale, then '#### answer'): the gold answer is what "
                    "follows ####, the rationale the solution where the row has none", source, gsm8k, len(rows))
    if boxed_in_solution:
        logger.info("%s: no answer column: each gold answer is its solution's last \\boxed{}", source)
    if wrapped["dapo"]:
        logger.info("%s: %d prompts are DAPO's instruction to end with a line 'Answer: ...' around a problem: the "
                    "problem alone is asked (the reward reads the reply's last \\boxed{})", source, wrapped["dapo"])
    if wrapped["simple-evals"]:
        logger.info("%s: %d prompts are simple-evals' instruction to end with a line 'Answer: ...', not a \\boxed "
                    "one, around a problem: the problem alone is asked (the reward reads the reply's last \\boxed{})",
                    source, wrapped["simple-evals"])
    if blank_boxed:
        logger.info("%s: %d rows have a blank answer: their gold answer is their solution's last \\boxed{}", source,
                    blank_boxed)
    if no_solution and for_hints:
        msg = (f"{source}: {no_solution} of {len(rows)} rows have no 'solution'; their hints will be built "
               f"answer-free from the problem only")
        logger.warning(msg)
        warnings.warn(msg, stacklevel=3)
    check_unique(rows, source, row_numbers=at)
    return rows


def _lone_surrogate(text: str) -> str | None:
    """Where `text` holds a code point UTF-8 cannot encode (a lone surrogate, which JSON's \\ud83d escapes can give):
    the code point and the text around it; None for valid Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(text[e.start]):04X} at character {e.start}: {text[max(0, e.start - 30):e.end + 30]!r}"
    return None


def check_unique(rows: Sequence[Mapping[str, Any]], source: str, first_row: int = 0,
                 row_numbers: Sequence[int] | None = None) -> None:
    """A DataError naming the prompt ids that more than one row of `rows` (in the row schema) has, and the rows
    (counted from `first_row`, or each one's number in `row_numbers` where rows were left out) that share the first:
    training groups rollouts, and evaluation keys results, by prompt id. An id made from the problem (h-..., a row
    without one) is in no file: the rows are how to find it."""
    seen: dict[str, list[int]] = {}
    numbers = range(first_row, first_row + len(rows)) if row_numbers is None else row_numbers
    for i, r in zip(numbers, rows, strict=True):
        seen.setdefault(r["prompt_id"], []).append(i)
    dups = [k for k, at in seen.items() if len(at) > 1]
    if dups:
        at = seen[dups[0]]
        raise DataError(f"{source}: {len(dups)} prompt ids are given to more than one row, e.g. {dups[:5]} (rows "
                        f"{', '.join(map(str, at[:-1]))} and {at[-1]} share {dups[0]!r}; a row without an id has one "
                        "made from its problem, the same for the same problem); groups and results are keyed by "
                        "prompt id: give each row a unique 'prompt_id'/'id'/'index'")


ROW_COLUMNS = ("prompt", "problem", "solution", "answer", "prompt_id", "difficulty")


def is_normalised(row: Mapping[str, Any]) -> bool:
    """Whether `row` already is in the row schema, as normalise_records returns it (normalising it again changes
    none of these columns): a chat prompt with a user turn, str problem/solution/prompt_id, an answer free of
    \\boxed{} and of GSM8K's '####', an int difficulty, and a problem and user turns that no DAPO or simple-evals
    instruction wraps (normalise_records asks the bare problem)."""
    if not all(c in row for c in ROW_COLUMNS):
        return False
    prompt, answer, difficulty = row["prompt"], row["answer"], row["difficulty"]
    return (isinstance(prompt, list) and all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in prompt)
            and any(m["role"] == "user" for m in prompt)
            and all(isinstance(row[c], str) for c in ("problem", "solution", "answer", "prompt_id"))
            and bool(row["problem"].strip()) and bool(answer) and strip_boxed(answer) == answer
            and split_gsm8k(answer) is None and isinstance(difficulty, int) and not isinstance(difficulty, bool)
            and not any(_wrapped(t) for t in [row["problem"]] + [m["content"] for m in prompt if m["role"] == "user"]))


def _wrapped(text: str) -> bool:
    """Whether `text` is a problem inside DAPO's or simple-evals' instruction wrapper (normalise_records removes it)."""
    return unwrap_dapo(text) != text or unwrap_simple_evals(text) != text


def to_dataset(rows: list[dict[str, Any]]):
    import datasets

    return datasets.Dataset.from_list(rows)


def load_rows(source: str, split: str = "train", limit: int | None = None, system_prompt: str | None = None,
              seed: int = 0, for_hints: bool = True, **kwargs: Any):
    """Load `source` into a `datasets.Dataset` in the row schema.

    source: "synthetic" (kwargs: `n` or `num_prompts` rows, default `limit` or 64; `difficulty`), a .parquet,
    .jsonl or .json file, a local dataset folder, or an HF dataset name (network; never used in tests).
    `limit` keeps the first rows (no shuffling). The input file is only read.
    """
    if source == "synthetic":
        n = kwargs.pop("n", None) or kwargs.pop("num_prompts", None) or limit or 64
        difficulty = kwargs.pop("difficulty", "mixed")
        if kwargs:
            raise TypeError(f"unexpected arguments for the synthetic source: {sorted(kwargs)}")
        rows = synthetic_rows(n if limit is None else min(n, limit), seed=seed, difficulty=difficulty,
                              system_prompt=system_prompt)
        return to_dataset(rows)
    if kwargs:
        raise TypeError(f"unexpected arguments for source {source!r}: {sorted(kwargs)}")
    records, name = read_records(source, split)
    if limit is not None:
        records = records[:limit]
    return to_dataset(normalise_records(records, name, system_prompt, for_hints=for_hints))


def system_prompt_for(spec: Any) -> str | None:
    """The tiny model is trained without a system turn; real instruct models get the paper's system prompt."""
    return None if getattr(spec, "model", "tiny") == "tiny" else prompts.SYSTEM_PROMPT


def build_dataset(spec: Any):
    """The training rows of a RunSpec (synthetic: spec.num_prompts rows of spec.difficulty with spec.seed)."""
    system = system_prompt_for(spec)
    if spec.data == "synthetic":
        return to_dataset(synthetic_rows(spec.num_prompts, seed=spec.seed, difficulty=spec.difficulty,
                                         system_prompt=system))
    return load_rows(spec.data, split=spec.data_split, limit=spec.num_prompts, system_prompt=system)


def prompt_lengths(prompts_: list, tokenizer) -> list[int]:
    """Token counts of policy prompts as the trainer tokenizes them: chat prompts through the chat template with
    the generation prompt (TRL's `_tokenize_prompts`), plain strings as they are."""
    out = []
    for p in prompts_:
        if isinstance(p, str):
            out.append(len(tokenizer(p)["input_ids"]))
        else:
            enc = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
            out.append(len(enc["input_ids"]))
    return out


def drop_long_prompts(dataset, tokenizer, max_len: int):
    """(rows whose prompt fits in `max_len` tokens, [(prompt_id, length)] of the rows dropped). A longer prompt
    (its hint not counted: the context has room for it) would not fit vLLM's context; dropping it at load, as
    verl's filter_overlong_prompts does, keeps it from failing one rank mid-run while the others wait."""
    lengths = prompt_lengths(dataset["prompt"], tokenizer)
    keep = [i for i, n in enumerate(lengths) if n <= max_len]
    dropped = [(str(dataset[i]["prompt_id"]), n) for i, n in enumerate(lengths) if n > max_len]
    return (dataset.select(keep) if dropped else dataset), dropped


EVAL_SEED_OFFSET = 100_003


def slug(s: str) -> str:
    """Lowercase letters, digits and dashes (what Prefect artifact keys accept)."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", s.lower())).strip("-") or "x"


def source_name(source: str) -> str:
    """A data source's short name: 'synthetic', a file's stem, a data set's last part with its configuration."""
    return slug(Path(source).stem or source)


def heldout_name(spec: Any) -> str:
    """The name eval_rows(spec) is reported under: `<data>-heldout`."""
    return f"{source_name(spec.data)}-heldout"


def benchmark_rows(spec: Any, source: str):
    """Rows of one benchmark: 'heldout' -> the held-out rows of spec.data (eval_rows); 'synthetic' -> held-out
    synthetic rows (those of the spec trained on the synthetic task); else a .parquet/.jsonl/.json file of rows, or a
    data set's (or a .json file of splits') first split of test, validation, train (load_benchmark), cut to
    spec.eval_num_prompts rows. The spec's model decides the system turn (none for 'tiny', the paper's prompt
    otherwise), as in training."""
    if source == "heldout" or source == "synthetic" == spec.data:
        return eval_rows(spec)
    if source == "synthetic":
        return eval_rows(spec.model_copy(update={"data": "synthetic"}))
    return load_benchmark(source, limit=spec.eval_num_prompts, system_prompt=system_prompt_for(spec))


def _evaluates_heldout(spec: Any) -> bool:
    """Whether the eval while training takes the held-out rows of spec.data: no eval_data, 'heldout', or the
    training source itself (its first rows are the training rows)."""
    from .spec import absolute_path

    return spec.eval_data in (None, "heldout") or absolute_path(spec.eval_data) == absolute_path(spec.data)


def eval_set_name(spec: Any) -> str:
    """The name of the set evaluated while training (eval_every), in its metrics' names."""
    if _evaluates_heldout(spec):
        return heldout_name(spec)
    return "synthetic-heldout" if spec.eval_data == "synthetic" else source_name(spec.eval_data)


def eval_set_rows(spec: Any):
    """The rows evaluated while training (eval_every): spec.eval_data's, the held-out rows of spec.data where it
    names none or that same source."""
    return eval_rows(spec) if _evaluates_heldout(spec) else benchmark_rows(spec, spec.eval_data)


def eval_rows(spec: Any):
    """Held-out no-hint evaluation rows of a RunSpec (spec.eval_num_prompts of them).

    synthetic: seed spec.seed + EVAL_SEED_OFFSET, difficulty mixed, problems of the training set excluded.
    A file of rows, or a folder of a single Dataset written by save_to_disk (it has no splits): the rows after the
    first spec.num_prompts (the training rows). A dataset folder, an HF name or a .json file of splits ({"train":
    [...], "test": [...]}): its 'test' or 'validation' split that is not the training split (spec.data_split), else
    (MATH-500 has only 'test', a local folder or a .json file may have only 'train') the training split's rows after
    the training rows.
    """
    system = system_prompt_for(spec)
    n = spec.eval_num_prompts
    if spec.data == "synthetic":
        train = {r["problem"] for r in synthetic_rows(spec.num_prompts, seed=spec.seed, difficulty=spec.difficulty)}
        rows = [r for r in synthetic_rows(2 * n + 16, seed=spec.seed + EVAL_SEED_OFFSET, difficulty="mixed",
                                          system_prompt=system) if r["problem"] not in train][:n]
        return to_dataset(rows)
    eval_splits = tuple(s for s in ("test", "validation") if s != spec.data_split)
    path = Path(spec.data).expanduser()
    if _is_data_file(path):  # read once: a file of rows, or a .json file of splits
        content, name = _read_data_file(path)
        # a .json file's test split, as a data set's (its 'train' rows after the training rows were taken)
        if held := [s for s in eval_splits if s in _json_splits(content)]:
            return to_dataset(normalise_records(_split_rows(content, held[0], name)[:n], name, system,
                                                for_hints=False))
        records = _split_rows(content, spec.data_split, name)
    else:
        if _saved_to_disk(path) != "dataset":
            try:
                return load_benchmark(spec.data, n, system, splits=eval_splits)
            except MissingSplit:
                pass  # no other split to evaluate on: the training split's rows after the training rows
        records, name = read_records(spec.data, spec.data_split)
    rest = records[spec.num_prompts:spec.num_prompts + n]
    if not rest:
        raise DataError(f"{name}: no rows left for evaluation after the first {spec.num_prompts} training rows: it "
                        f"has {len(records)} row{'' if len(records) == 1 else 's'}, all of them within the first "
                        f"{spec.num_prompts} (num_prompts)")
    return to_dataset(normalise_records(rest, name, system, first_row=spec.num_prompts, for_hints=False))


def load_benchmark(source: str, limit: int | None = None, system_prompt: str | None = None,
                   splits: Sequence[str] = ("test", "validation", "train")):
    """A benchmark's rows: a file of rows as it is; a dataset folder or HF name (NAME[:CONFIG]), or a .json file of
    splits ({"train": [...], "test": [...]}), from the first of `splits` it has (MATH-500 has only 'test', some AIME
    sets only 'train'); a MissingSplit (a DataError) where it has none."""
    missing: list[MissingSplit] = []
    for split in splits:
        try:
            return load_rows(source, split=split, limit=limit, system_prompt=system_prompt, for_hints=False)
        except MissingSplit as e:
            missing.append(e)
    why = missing[-1].__cause__ or missing[-1]
    raise MissingSplit(f"{source}: no {' or '.join(map(repr, splits))} split for evaluation ({why})")
