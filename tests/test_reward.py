"""The boxed math-verify reward: extraction, equivalences, hostile inputs (never hang, never raise, any thread)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from sage_core import reward
from sage_core.data import synthetic_rows
from sage_core.reward import boxed_reward, extract_boxed, score

HOSTILE = [
    "\\boxed{10^{10^{10}}}",
    "\\boxed{9**9**9}",
    "\\boxed{2^{2^{2^{2^{2}}}}}",
    "\\boxed{2^{123456789}}",
    "\\boxed{99999999!}",
    "\\boxed{10^(10)^(10)}",
    "\\boxed{10^{2 \\cdot 10^{10}}}",
    "\\boxed{(10^{9})!}",
    "\\boxed{((9999)!)!}",
    "\\boxed{9999!!}",
    "\\boxed{\\binom{1000000000}{500000000}}",
    "\\boxed{(x+1)^{9999}}",
    "\\boxed{" + "{" * 2000 + "1" + "}" * 2000 + "}",
    "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "\\boxed{" + "1+" * 50_000 + "1}",
    "x" * 1_000_000 + "\\boxed{3}",
    "\\boxed{" * 100_000,
    "\\boxed{}",
    "\\boxed",
    "}" * 1000 + "\\boxed{{{",
    "\\boxed{\\begin{matrix}" + "1&" * 5000 + "1\\end{matrix}}",
    "",
]


@pytest.mark.parametrize("text,expected", [
    ("The answer is \\boxed{9} .", "9"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed {42}", "42"),
    ("\\fbox{7}", "7"),
    ("\\boxed 5", "5"),
    ("no box here 9", None),
    ("\\boxed{3", None),
    # \boxed followed by a word is prose about boxes, not an answer: the box before it counts
    ("so \\boxed{9} , in \\boxed notation", "9"),
    ("put it in \\boxed form", None),
    ("\\boxed x", "x"),
    ("", None),
])
def test_extract_boxed_takes_the_last_balanced_box(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("pred,gold", [
    ("9", "9"),
    ("9.0", "9"),
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{3}{4}", "0.75"),
    ("1,000", "1000"),
    ("-3", "- 3"),
    ("12 .", "12"),
    ("x^2+2x+1", "(x+1)^2"),           # needs math-verify (worker pool)
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
    ("\\pi", "\\pi"),
    ("1{,}234", "1234"),
    # a power in an exponent is fine where it is small or symbolic (only numeric towers are refused unparsed)
    ("2^{2^{3}}", "256"),
    ("256", "2^{2^3}"),
    ("e^{x^2} \\cdot 2x", "2xe^{x^2}"),
    ("x^{2^{2}}", "x^4"),
])
def test_equivalent_forms_score_one(pred, gold):
    assert score(f"so \\boxed{{{pred}}}", gold) == 1.0


@pytest.mark.parametrize("pred,gold", [
    ("8", "9"), ("0.51", "\\frac{1}{2}"), ("x^2+1", "(x+1)^2"), ("10", "1"), ("-9", "9"),
    # numbers are compared exactly (decimals to math-verify's 6 places), not within a relative tolerance
    ("1000001", "1000000"), ("123456700", "123456789"), ("1234.569", "1234.5678"),
    # "1, 234" is a list of two numbers, not 1234
    ("1, 234", "1234"), ("1100", "1, 100"),
    # \left( is dropped, the \left of \leftarrow is not
    ("\\leftarrow", "\\rightarrow"),
])
def test_wrong_answers_score_zero(pred, gold):
    assert score(f"\\boxed{{{pred}}}", gold) == 0.0


def test_no_box_or_non_string_scores_zero():
    assert score("The answer is 9 .", "9") == 0.0
    assert score(None, "9") == 0.0  # type: ignore[arg-type]
    assert score(["\\boxed{9}"], "9") == 0.0  # type: ignore[arg-type]


def test_only_the_last_box_counts():
    assert score("\\boxed{9} no wait \\boxed{8}", "9") == 0.0
    assert score("\\boxed{8} no wait \\boxed{9}", "9") == 1.0


def test_synthetic_reference_solutions_score_one_and_fast():
    rows = synthetic_rows(300, seed=3)
    t0 = time.perf_counter()
    assert all(score(r["solution"], r["answer"]) == 1.0 for r in rows)
    assert time.perf_counter() - t0 < 1.0  # the fast path: no subprocess round trips


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_inputs_score_zero_quickly(text):
    t0 = time.perf_counter()
    assert score(text, "3") == 0.0
    assert time.perf_counter() - t0 < 3.0


def test_hostile_inputs_in_a_worker_thread():
    """Prefect runs tasks in worker threads, where signal-based timeouts do not work."""
    results: list[float] = []

    def run():
        for text in HOSTILE:
            results.append(score(text, "3"))
        results.append(score("\\boxed{(x+1)^2}", "x^2+2x+1"))  # the pool path, from a thread

    t0 = time.perf_counter()
    th = threading.Thread(target=run)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive()
    assert results == [0.0] * len(HOSTILE) + [1.0]
    assert time.perf_counter() - t0 < 30


def test_slow_sympy_times_out_from_a_thread_and_the_pool_recovers():
    """An input the guards let through but sympy chews on for minutes: 0 after the timeout, then scoring works."""
    slow = "\\boxed{\\sin(x)^{2}+\\cos(x)^{2}+(x+1)^{500}}"
    out: list[float] = []
    th = threading.Thread(target=lambda: out.append(score(slow, "1", timeout=2.0)))
    t0 = time.perf_counter()
    th.start()
    th.join(timeout=60)
    elapsed = time.perf_counter() - t0
    assert out == [0.0]
    assert elapsed < 15  # 2 s timeout plus a worker start on a busy machine
    assert score("\\boxed{(x+1)^2}", "x^2+2x+1") == 1.0


def test_concurrent_threads_get_their_own_results():
    cases = [("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0), ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
             ("\\boxed{\\frac{\\sqrt{3}}{3}}", "1/\\sqrt{3}", 1.0), ("\\boxed{\\sqrt{3}}", "1/\\sqrt{3}", 0.0)] * 3
    results: dict[int, float] = {}

    def run(i, c, g):
        results[i] = score(c, g)

    threads = [threading.Thread(target=run, args=(i, c, g)) for i, (c, g, _) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(len(cases))] == [e for _, _, e in cases]


def test_boxed_reward_is_a_trl_reward_function():
    assert boxed_reward.__name__ == "accuracy"
    completions = [[{"role": "assistant", "content": "7 + 5 = 12 . The answer is \\boxed{12} ."}],
                   [{"role": "assistant", "content": "The answer is \\boxed{13} ."}],
                   "plain text \\boxed{0.5}",
                   "no box"]
    assert boxed_reward(completions, answer=["12", "12", "\\frac{1}{2}", "1"], prompts=None,
                        trainer_state=None) == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        boxed_reward(["\\boxed{1}"], answer=["1", "2"])


def test_fast_path_decides_numbers_without_the_pool():
    assert reward.fast_score("9.0", "9") == 1.0
    assert reward.fast_score("\\frac{1}{2}", "0.5") == 1.0
    assert reward.fast_score("8", "9") == 0.0
    assert reward.fast_score("x+1", "1+x") is None



def test_pool_warms_in_the_background_and_the_first_odd_answer_reuses_that_worker(monkeypatch):
    monkeypatch.setattr(reward, "_pool", reward._Pool(1))
    started = []
    real_worker = reward._Worker

    def counting_worker():
        started.append(1)
        return real_worker()

    monkeypatch.setattr(reward, "_Worker", counting_worker)
    reward.warm_pool_in_background().join(timeout=120)
    assert started == [1]
    assert reward.score("\\boxed{15Then}", "16") == 0.0  # not decided by the fast path: math-verify says 0
    assert reward.score("\\boxed{x+1}", "1+x") == 1.0
    assert started == [1]  # both answers went to the worker started in the background
    reward._pool.close()


@pytest.mark.parametrize("name,value", [("SAGE_REWARD_TIMEOUT", "0"), ("SAGE_REWARD_TIMEOUT", "inf"),
                                        ("SAGE_REWARD_TIMEOUT", "5s"), ("SAGE_REWARD_WORKERS", "0"),
                                        ("SAGE_REWARD_WORKERS", "2.5")])
def test_a_bad_reward_setting_in_the_environment_is_named(name, value):
    """0 or inf seconds would score every answer math-verify decides 0 (and kill a worker each time) or never time
    out; a value that is no number failed with float()'s message naming no variable."""
    import subprocess
    import sys

    env = {**os.environ, name: value}
    out = subprocess.run([sys.executable, "-c", "import sage_core.reward"], env=env, capture_output=True, text=True,
                         cwd=str(Path(reward.__file__).resolve().parents[1]))
    assert out.returncode != 0 and f"ValueError: {name}={value!r}: must be a positive" in out.stderr, out.stderr
