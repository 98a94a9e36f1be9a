"""The verifiable reward: 1.0 when the last \\boxed{...} of a completion equals the gold answer (math-verify), else 0.0.

Design (works from any thread, never hangs, never raises):
- guards: no box, an absurdly long completion or boxed answer, huge exponents/factorials or deep nesting -> 0.0;
- a fast path decides plain numbers and identical strings in-process (the common case, e.g. the synthetic task);
  it reads numbers as numbers, so `5.` = `5`, `1.` = `1.0` and `1e3` = `1000` score 1, which the paper's
  math-verify setup scores 0 (its misses, judged here as not worth copying);
- everything else goes to math-verify in a small persistent pool of worker subprocesses (`python -m
  sage_core.reward --worker`, JSON lines over pipes) with math-verify's own signal-based timeouts off and a
  per-call timeout enforced by the caller; a worker that times out is killed (and replaced on next use), the
  sample scores 0.0. Signal-based timeouts only work in the main thread, Prefect runs tasks in worker threads,
  hence the subprocesses.

Env: SAGE_REWARD_TIMEOUT (seconds per sample, default 5), SAGE_REWARD_WORKERS (pool size, default 2).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAX_COMPLETION_CHARS = 200_000   # longer completions score 0 without being parsed
MAX_ANSWER_CHARS = 300           # longer boxed answers score 0
MAX_BRACE_DEPTH = 12


def _env_number(name: str, default: str, kind: type = float) -> float:
    """A positive, finite number from the environment; a ValueError naming the variable for any other value (0 or
    inf seconds would score every answer math-verify must decide 0, or never time out)."""
    raw = os.environ.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        what = "a positive whole number" if kind is int else "a positive, finite number of seconds"
        raise ValueError(f"{name}={raw!r}: must be {what}")
    return value


TIMEOUT_S = _env_number("SAGE_REWARD_TIMEOUT", "5")
WORKER_START_TIMEOUT_S = 120.0   # importing sympy + math_verify on a busy 2-core machine
N_WORKERS = _env_number("SAGE_REWARD_WORKERS", "2", int)


# ----------------------------------------------------------------------------------------------------------------
# extraction and guards
# ----------------------------------------------------------------------------------------------------------------

def extract_boxed(text: str) -> str | None:
    """The content of the LAST \\boxed{...} (or \\fbox{...}), brace-balanced; None when there is none or the last
    one is unbalanced. Linear time."""
    if not isinstance(text, str):
        return None
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    # "\\boxed" followed by a word is prose about boxes ("in \\boxed notation"), not an answer: take the box before
    while re.match(r"\\(?:boxed|fbox) *[A-Za-z]{2,}(?![{}^_\\\w])", text[i:i + 64]):
        i = max(text.rfind("\\boxed", 0, i), text.rfind("\\fbox", 0, i))
        if i < 0:
            return None
    j = i + (6 if text.startswith("\\boxed", i) else 5)
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for k in range(j, len(text)):
            c = text[k]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1:k]
        return None
    m = re.match(r"\\boxed ([^\s$]+)", text[i:i + MAX_ANSWER_CHARS + 8])  # "\\boxed 9"
    return m.group(1) if m else None


_POW_RE = re.compile(r"(\^|\*\*)\s*\{?\s*\(?\s*[-+]?\s*(\d+)")


def _group_after(expr: str, i: int) -> str:
    """The brace/paren group opening at expr[i] (to the end of the string when unbalanced)."""
    open_c = expr[i]
    close_c = "}" if open_c == "{" else ")"
    depth = 0
    for k in range(i, len(expr)):
        depth += (expr[k] == open_c) - (expr[k] == close_c)
        if depth == 0:
            return expr[i + 1:k]
    return expr[i + 1:]


TOWER_LIMIT = 10**4  # a number in an exponent up to this is fine: 2^{2^3}; 10^{10^{10}} is not
_DECIMAL = re.compile(r"\d+(?:\.\d+)?")


def _tower(t: str, i: int = 0) -> tuple[float, int] | None:
    """(value, end) of the power tower of numbers and parentheses starting at t[i] (t: '^' for powers, parentheses
    for braces, no spaces), its value inf past TOWER_LIMIT; None where t[i:] does not start with one."""
    if i < len(t) and t[i] == "(":
        inner = _tower(t, i + 1)
        if inner is None or inner[1] >= len(t) or t[inner[1]] != ")":
            return None
        base, j = inner[0], inner[1] + 1
    else:
        m = _DECIMAL.match(t, i)
        if m is None:
            return None
        base, j = float(m.group()), m.end()
    if j < len(t) and t[j] == "^":
        exp = _tower(t, j + 1)
        if exp is None:
            return None
        if base <= 1 or exp[0] == 0:
            return (1.0 if exp[0] == 0 or base == 1 else base ** min(exp[0], 64)), exp[1]
        if exp[0] == float("inf") or exp[0] * math.log10(base) > math.log10(TOWER_LIMIT):
            return float("inf"), exp[1]
        return base ** exp[0], exp[1]
    return base, j


def _huge_exponent(inner: str) -> bool:
    """True for an exponent holding a power that sympy could choke on: a numeric power past TOWER_LIMIT (the
    {10^{10}} of 10^{10^{10}}), or one that is not plain numbers (2 \\cdot 10^{10}); a symbolic one (the {x^2} of
    e^{x^2}) is fine."""
    if re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", inner)):
        return False
    t = re.sub(r"\s", "", inner).replace("**", "^").translate(str.maketrans("{}", "()"))
    found = _tower(t)
    return found is None or found[1] != len(t) or found[0] == float("inf")


def _too_hard(expr: str) -> bool:
    """True for inputs that could make sympy hang or blow up memory: very long or deeply nested input, stacked
    numeric powers past TOWER_LIMIT (10^{10^{10}}, 9**9**9), exponents over 4 digits, factorials of 5+ digit
    numbers, of powers or of factorials, binomials of 5+ digit numbers."""
    if len(expr) > MAX_ANSWER_CHARS:
        return True
    depth = peak = 0
    for c in expr:
        if c in "{([":
            depth += 1
            peak = max(peak, depth)
        elif c in "})]":
            depth -= 1
    if peak > MAX_BRACE_DEPTH:
        return True
    for m in re.finditer(r"(\^|\*\*)\s*([{(])", expr):
        inner = _group_after(expr, m.end() - 1)
        if ("^" in inner or "**" in inner) and _huge_exponent(inner):
            return True
    term = r"(?:[\w.]+|\([^()]*\)|\{[^{}]*\})"
    for m in re.finditer(rf"(?:\^|\*\*)\s*((?:{term}\s*(?:\^|\*\*)\s*)+{term})", expr):  # 9**9**9, 10^(10)^(10)
        if _huge_exponent(m.group(1)):
            return True
    if any(len(m.group(2)) > 4 for m in _POW_RE.finditer(expr)):
        return True
    if re.search(r"\d{5,}\s*!|\d{3,}\s*!\s*!|\\binom\s*\{?\s*\d{5,}", expr):  # 99999!, 9999!!, \binom{10^9}...
        return True
    # a sum or product in brackets raised to a 4-digit power: (x+1)^{9999} expands for seconds
    for m in re.finditer(r"[)}]\s*(?:\^|\*\*)\s*\{?\s*\(?\s*(\d{4})", expr):
        base = expr[_group_start(expr, m.start()):m.start()]
        if re.search(r"[a-zA-Z]", base) and re.search(r"[-+*/]|\\cdot", base):
            return True
    for m in re.finditer(r"[)}]\s*!", expr):  # (10^{9})!, ((9999)!)!
        start = _group_start(expr, m.start())
        if any(c in expr[start:m.start()] for c in "^!") or re.search(r"\d{5,}", expr[start:m.start()]):
            return True
    return False


def _group_start(expr: str, close: int) -> int:
    """The index of the bracket that opens the group closing at expr[close] (0 when unbalanced)."""
    close_c = expr[close]
    open_c = "{" if close_c == "}" else "("
    depth = 0
    for k in range(close, -1, -1):
        depth += (expr[k] == close_c) - (expr[k] == open_c)
        if depth == 0:
            return k
    return 0


_NUM_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d{1,3})?")


def _normalise(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])|\\[!,;:]|\\displaystyle", "", s)  # (the \left of \leftarrow stays)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s).replace("{,}", ",")
    spaced = re.search(r",\s", s) is not None  # "1, 234" is two numbers, "1,234" one
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if not spaced and re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _as_number(s: str) -> Fraction | None:
    if _NUM_RE.fullmatch(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = re.fullmatch(r"([-+]?)\\frac\{(\d+)\}\{(\d+)\}", s)
    if m and int(m.group(3)) != 0:
        return Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) == "-" else 1)
    return None


def fast_score(pred: str, gold: str) -> float | None:
    """1.0/0.0 when it can be decided without math-verify (identical after normalisation, or both plain numbers);
    None otherwise."""
    p, g = _normalise(pred), _normalise(gold)
    if p == g and p:
        return 1.0
    pn, gn = _as_number(p), _as_number(g)
    if pn is not None and gn is not None:
        if pn == gn:
            return 1.0
        # math-verify compares integers and fractions exactly, and decimals rounded to 6 places: two values within
        # 1e-6 of each other where one is a decimal may round alike, and math-verify decides those
        decimal = any(re.search(r"[.eE]", x) for x in (p, g))
        return None if decimal and abs(pn - gn) <= Fraction(1, 10**6) else 0.0
    return None


# ----------------------------------------------------------------------------------------------------------------
# the worker pool
# ----------------------------------------------------------------------------------------------------------------

class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.proc = subprocess.Popen([sys.executable, "-m", "sage_core.reward", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                                     bufsize=1)
        line = self._readline(WORKER_START_TIMEOUT_S)
        if line is None or line.strip() != "ready":
            self.kill()
            raise RuntimeError("reward worker failed to start")

    def _readline(self, timeout: float) -> str | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return line or None

    def verify(self, pred: str, gold: str, timeout: float) -> float | None:
        """The score, or None on timeout/crash (the worker is then dead)."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"pred": pred, "gold": gold}) + "\n")
            self.proc.stdin.flush()
            line = self._readline(timeout)
            if line is None:
                self.kill()
                return None
            return float(json.loads(line)["score"])
        except Exception:
            self.kill()
            return None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:
            pass


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(size):
            self.idle.put(None)  # a slot; the worker is started lazily

    @staticmethod
    def _started(worker: _Worker | None) -> _Worker:
        """A slot's worker, started when the slot is empty or its worker died."""
        return worker if worker is not None and worker.alive else _Worker()

    def verify(self, pred: str, gold: str, timeout: float) -> float:
        worker = self.idle.get()
        try:
            worker = self._started(worker)
            result = worker.verify(pred, gold, timeout)
            if result is None:
                logger.warning("reward: math-verify timed out after %.1fs on %r; scoring 0", timeout, pred[:80])
                worker = None
                return 0.0
            return result
        except Exception as e:  # worker start failure
            logger.warning("reward: worker error (%s); scoring 0", e)
            worker = None
            return 0.0
        finally:
            self.idle.put(worker if worker is not None and worker.alive else None)

    def warm(self) -> None:
        """Start one idle slot's worker (blocks while it imports sympy and math-verify, about a second)."""
        worker = self.idle.get()
        try:
            worker = self._started(worker)
        except Exception as e:  # started lazily on first use instead, as before
            logger.warning("reward: worker did not start (%s)", e)
            worker = None
        finally:
            self.idle.put(worker)

    def close(self) -> None:
        while True:
            try:
                w = self.idle.get_nowait()
            except queue.Empty:
                break
            if w is not None:
                w.kill()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool(N_WORKERS)
            atexit.register(_pool.close)
        return _pool


def warm_pool_in_background() -> threading.Thread:
    """Start a verifier worker in a background thread. The fast path decides most answers, but a run meets an odd
    one sooner or later (e.g. `\\boxed{15Then}` from the tiny policy under a hint), and a worker started on demand
    stalls that step for its imports (~1 s, a tenth of a small run); started here it overlaps model loading."""
    t = threading.Thread(target=lambda: _get_pool().warm(), name="sage-reward-warm", daemon=True)
    t.start()
    return t


def _verify_in_process(pred: str, gold: str) -> float:
    """math-verify with its signal timeouts off (for the worker's main thread)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                        parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=None) else 0.0


def _worker_main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol owns stdout; stray prints go to stderr (discarded)
    logging.disable(logging.WARNING)  # math-verify warns on every call that its timeouts are off
    import math_verify  # noqa: F401  (warm the imports before saying ready)
    import sympy  # noqa: F401

    sys.setrecursionlimit(10_000)
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            score = _verify_in_process(req["pred"], req["gold"])
        except BaseException:
            score = 0.0
        out.write(json.dumps({"score": score}) + "\n")
        out.flush()


# ----------------------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------------------

def score(completion: str, gold: str, timeout: float | None = None) -> float:
    """1.0 when the last \\boxed{} of `completion` is equivalent to `gold`, else 0.0. Never raises, never hangs."""
    try:
        if not isinstance(completion, str) or not completion or len(completion) > MAX_COMPLETION_CHARS:
            return 0.0
        pred = extract_boxed(completion)
        if pred is None or not pred.strip():
            return 0.0
        gold = str(gold)
        fast = fast_score(pred, gold)
        if fast is not None:
            return fast
        if _too_hard(pred) or _too_hard(gold):
            return 0.0
        return _get_pool().verify(pred, gold, TIMEOUT_S if timeout is None else timeout)
    except Exception as e:  # never raise into the trainer
        logger.warning("reward: scoring failed (%s); scoring 0", e)
        return 0.0


def completion_text(completion: Any) -> str:
    """The assistant text of a completion: a string, or TRL's conversational [{role, content}] form."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}, ...]
        parts = [m.get("content") for m in completion if isinstance(m, dict) and m.get("role", "assistant") ==
                 "assistant"]
        return "".join(p for p in parts if isinstance(p, str))
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return ""


def boxed_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL reward function: math-verify accuracy of the last \\boxed{} against the `answer` column."""
    if len(completions) != len(answer):
        raise ValueError(f"boxed_reward: {len(completions)} completions but {len(answer)} answers")
    return [score(completion_text(c), a) for c, a in zip(completions, answer)]


boxed_reward.__name__ = "accuracy"
boxed_reward.__qualname__ = "accuracy"


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main()
