"""Hints h for a prompt x: a lossy compression of the reference solution at level 1 (minimal), 2 (medium) or
3 (detailed), never the final answer. Level 0 is the empty hint (deployment and evaluation).

Three sources behind one interface, `HintSource.get(requests, ctx) -> results`:
  online  - the current policy writes the hint each time it is needed (the paper's best variant)
  fixed   - the initial policy writes every hint once, before the first update; cached to a JSONL file
  teacher - another model writes them: a JSONL/Parquet file of precomputed hints, a local model path, or an
            OpenAI-compatible endpoint (http[s]://.../v1)
Every hint passes the leak guard: a hint that contains the gold answer is rejected and recorded, never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from .atomic import atomic_path
from .data import DataError, MissingDataFile, _is_blank, read_records
from .prompts import LEVELS, chat, hint_request

log = logging.getLogger(__name__)

# generate(chat_prompts, max_new_tokens, temperature) -> completion texts, one per prompt (collective-safe in the
# trainer); temperature 0 means greedy. None for a prompt the model gave no answer to (a teacher endpoint down, a
# request over its context): that hint fails, and is not asked for again in the same sample_hints
GenerateFn = Callable[[list[list[dict]], int, float], list[str | None]]


@dataclass(frozen=True)
class HintRequest:
    prompt_id: str
    problem: str
    solution: str
    answer: str
    level: int


@dataclass
class HintResult:
    text: str | None  # None: no usable hint (failed or every sample leaked)
    leaked: bool = False  # at least one sample contained the answer and was rejected
    attempts: int = 0
    unanswered: bool = False  # its last request got no answer (None: a teacher endpoint down): a failure, not a leak

    @property
    def failed(self) -> bool:
        return self.text is None


@dataclass
class HintContext:
    """What a source may use from the trainer: the policy's generate, and cross-process gather."""

    generate: GenerateFn
    max_new_tokens: int = 48
    retries: int = 2
    temperature: float = 0.0  # the first sample of each hint (greedy, as the paper's code writes its hints)
    retry_temperature: float = 1.0  # resamples after a leak or an empty hint (greedy would repeat the first)
    gather: Callable[[list], list] = field(default=lambda xs: xs)  # all_gather_object, flattened
    rank: int = 0
    world: int = 1


# ----------------------------------------------------------------------------------------------- leak guard
def _clean(s: str) -> str:
    """Typesetting that does not change a LaTeX expression removed ($, \\left/\\right, thin spaces), \\dfrac and
    \\tfrac written \\frac, \u03c0 written \\pi, \u221e and the word infinity written \\infty, an exponent or
    subscript of one digit or letter unbraced (x^{2} is x^2), a root of one digit or letter braced (\\sqrt3, \\sqrt 3
    and \u221a3 are \\sqrt{3}; \u221a35 is \\sqrt{35}), whitespace collapsed: the form answers and hints are compared
    in (after _normal)."""
    s = re.sub(r"\$|\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[,;:!]", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s).replace(PI, "\\pi ").replace(INFINITY, "\\infty ")
    s = _INFINITY_WORD.sub(r"\\infty ", s)
    s = re.sub(r"([\^_])\{\s*([0-9A-Za-z])\s*\}", r"\1\2", s)  # x^{2} is x^2, a_{1} is a_1
    s = re.sub(r"\\sqrt\s*([0-9]|[A-Za-z](?![A-Za-z]))", r"\\sqrt{\1}", s)  # LaTeX: \sqrt 35 is \sqrt{3}5
    s = re.sub(r"\u221a\s*(\d+|[A-Za-z](?![A-Za-z]))", r"\\sqrt{\1}", s)  # the sign: √35 is \sqrt{35}
    return re.sub(r"\s+", " ", s).strip().rstrip(".")


PI = "\u03c0"  # as some models write \\pi
INFINITY = "\u221e"  # as some models write \\infty
_INFINITY_WORD = re.compile(r"(?<![\\\w])infinity(?!\w)", re.IGNORECASE)  # as a hint says \\infty in words
# \text{cm}: words inside maths, with one level of braces in them (\mathrm{mol^{-1}})
_TEXT = r"\\(?:text|textrm|textbf|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}"
_UNIT = _TEXT + r"(?:\^(?:-?\d|\{-?\d+\}))?"  # a unit after a number, its exponent with it: \text{ mol}^{-1}

# Characters a hint may write a number with, as the guard reads them: the dashes models write as a minus (the minus
# sign \u2212, the en dash \u2013, the figure dash, the small hyphen-minus) and as a hyphen (\u2010, and \u2011 as in
# forty\u2011two) as -, where "12\u20133" stays 12 and 3 as "12-3" does (the em dash is punctuation: left as it is,
# and read as a minus too only where it is one, _EM_MINUS);
# a vulgar fraction (\u00bd, \u00be, \u2153, ...) as \frac{1}{2} (so 2\u00bd is the mixed number 2\frac{1}{2}), the
# fraction slash as /; the full-width forms (\uff11\uff12, \uff0d\uff17, \uff11\uff0f\uff12) as ASCII and the
# ideographic space as a space; no character for the invisible ones (zero-width space, non-joiner and joiner, word
# joiner, byte order mark, soft hyphen), which may stand inside a number (1\u200b2 is 12). Not Unicode's NFKC, which
# writes \u00bd as 1\u20442 (2\u00bd would read 21/2) and a superscript as its digit (3\u00b2 would read 32).
_NORMAL = str.maketrans({
    **{c: "\\frac{%s}{%s}" % tuple(unicodedata.normalize("NFKC", c).split("\u2044"))
       for c in map(chr, [*range(0xBC, 0xBF), *range(0x2150, 0x215F), 0x2189])},  # \u215f is 1/ alone: not one
    "\u2044": "/", **dict.fromkeys("\u2010\u2011\u2012\u2013\u2212\ufe63", "-"),
    **{c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F)}, 0x3000: " ",
    **dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff\u00ad")})


# LaTeX's spaces that are only space (\quad, \qquad, "\ ", \enspace, \hspace{1em}, ...), read as a space: "x =\quad-3"
# is "x = -3", where the minus after the command's letters was no sign. The thin spaces \, \; \: \! stay: they
# also group digits (1\,234), which the guard reads as such (_quantities).
_LATEX_SPACE = re.compile(r"\\(?:(?:q?quad|enspace|enskip|thinspace|medspace|thickspace)(?![A-Za-z])"
                          r"|hspace\*?\s*\{[^{}]*\}| )")


def _normal(s: str) -> str:
    """`s` in the characters the leak guard reads (see _NORMAL), LaTeX's plain spaces as spaces (_LATEX_SPACE)."""
    return _LATEX_SPACE.sub(" ", s.translate(_NORMAL))


# A number in a hint or an answer: \frac{a}{b} (also \dfrac, \tfrac; a one-digit argument may go without braces, as
# in \frac12), a/b written without spaces (also before a sentence's period or comma: "it is 1/2."), 1,234 with
# thousands separators, or a plain integer or decimal (.5 too); a sign only where it cannot be a subtraction ("12-3"
# is 12 and 3).
_NUMBER = re.compile(r"(-?)\\[dt]?frac\s*(\{\s*-?\d+\s*\}|\d)\s*(\{\s*\d+\s*\}|\d)"
                     r"|(?<![\w.,/])(-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)(?![\w/]|[.,]\d)"
                     r"|(?<![\w.,])(-?\d{1,3}(?:,\d{3})+(?:\.\d+)?)(?!\d)"
                     r"|(?<![\w.])(-?(?:\d+(?:\.\d+)?|\.\d+))")


def _value(m: re.Match) -> Fraction | None:
    """The value of one number _NUMBER matched (None for a zero denominator)."""
    sign, num, den, a, b, grouped, plain = m.groups()
    if num is not None:
        num, den = int(num.strip("{} ")), int(den.strip("{} "))
        return Fraction(num, den) * (-1 if sign else 1) if den else None
    if a is not None:
        return Fraction(a) / Fraction(b) if Fraction(b) else None
    return Fraction((grouped or plain).replace(",", ""))


# A mixed number: 2\frac{1}{2} (\dfrac, \tfrac, \frac12 too) or 2 1/2, a proper fraction after a whole number
_MIXED = re.compile(r"(?<![\w.,/])(-?)(\d+)\s*(?:\\[dt]?frac\s*(\{\s*\d+\s*\}|\d)\s*(\{\s*\d+\s*\}|\d)"
                    r"|\s(\d+)/(\d+)(?![\w/]|[.,]\d))")
# A percentage: 50%, 50\%, 50 percent (also read as 1/2)
_PERCENT = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)\s*(?:\\?%|per\s*cent\b)", re.IGNORECASE)


# A run of more digits than any answer has (100! has 158), plain or grouped by commas: Python reads no number of over
# 4300 digits (a ValueError), and a hint that degenerates into digits must be rejected or passed, not stop the run
_HUGE = re.compile(r"\d{1001,}|\d{1,3}(?:,\d{3}){334,}")


def _no_huge(text: str) -> str:
    """`text` with each number of over 1000 digits (_HUGE) written as "#", which is no number."""
    return _HUGE.sub(" # ", text)


def _values(text: str) -> set[Fraction]:
    """The values of the numbers written in `text`, each in every reading: "1/2" is 1/2 and also 1 and 2, "3,400" is
    3400 and also 3 and 400, "12,100,200" (or "12 100 200", _quantities) also 12100 and 100200: each run of up to
    seven of its groups that the groups beside it leave a number of its own (not 10000 in 10,000,000: no number starts
    000; seven as for a space, and a hint's run of hundreds of groups is read in linear time), a sign before it the
    sign of the runs that start at its first group ("-12 100 200" is -12100 and 100200, as "-12100" is not 12100),
    "50%" is 50 and also 1/2, "2 1/2" is 2, 1/2 and also 5/2 (the guard rejects a hint on any reading). A number of
    over 1000 digits is none (_no_huge)."""
    text = _no_huge(text)
    out: set[Fraction] = {Fraction(m[1]) / 100 for m in _PERCENT.finditer(text)}
    for m in _MIXED.finditer(text):
        num, den = (int(x.strip("{} ")) for x in ((m[3], m[4]) if m[3] is not None else (m[5], m[6])))
        if 0 < num < den:
            out.add((int(m[2]) + Fraction(num, den)) * (-1 if m[1] else 1))
    for m in _NUMBER.finditer(text):
        if (v := _value(m)) is not None:
            out.add(v)
        _, _, _, a, b, grouped, _ = m.groups()
        if a is not None:
            out.update((Fraction(a), Fraction(b)))
        elif grouped is not None:
            groups = grouped.split(",")  # a sign is its first group's: -12,100,200 is -12, -12100, 100 and 100200
            out.update(map(Fraction, groups))
            out.update(Fraction("".join(groups[i:j])) for i in range(len(groups))
                       for j in range(i + 2, min(i + 7, len(groups)) + 1)
                       if (i == 0 or groups[i][0] != "0") and (j == len(groups) or groups[j][0] != "0"))
    return out


# Numbers written in words: cardinals (seventeen, forty-two, two hundred and five; digits before a scale word, as in
# 3 thousand or 2.5 million, are one number too),
# "negative" before one, and fractions (two thirds, one half, a quarter, three fifths). "one" and "a" alone are not
# read as 1 (no one, one of them, a step): only in a compound (twenty-one, one hundred) or before a fraction's
# denominator; ordinals alone (the third step) are not numbers.
_UNITS = {w: i for i, w in enumerate([
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen",
    "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"])}
_TENS = {w: 10 * i for i, w in enumerate(["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"],
                                          start=2)}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_DENOMINATORS = {"half": 2, "halves": 2, "third": 3, "quarter": 4, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7,
                 "eighth": 8, "ninth": 9, "tenth": 10}
_CARDINAL = "|".join([*_UNITS, *_TENS, *_SCALES])
_SCALED = re.compile(rf"(?<![\w.,])(-?\d+(?:\.\d+)?)[\s-]*({'|'.join(_SCALES)})\b", re.IGNORECASE)  # 3 thousand
_WORD_NUMBER = re.compile(
    rf"\b(?:(negative|minus)\s+)?((?:{_CARDINAL}|a)(?:(?:\s+and\s+|[\s-]+)(?:{_CARDINAL}))*)"
    rf"(?:[\s-]+({'|'.join(_DENOMINATORS)})s?)?\b", re.IGNORECASE)


def _cardinal(words: list[str]) -> int | None:
    """The value of cardinal number words (["two", "hundred", "five"] -> 205); None for a sequence that is not one
    number (two three)."""
    total, current, last = 0, 0, None
    for w in words:
        if w in _UNITS or w in _TENS:
            v = _UNITS.get(w, _TENS.get(w))
            if last is not None and last not in _SCALES and not (last in _TENS and w in _UNITS and 0 < v < 10):
                return None  # "two three", "twenty thirty", "twelve five": two numbers, not one
            current += v
        else:
            if current == 0:
                current = 1  # "hundred" alone, as in "a hundred"
            if w == "hundred":
                current *= 100
            else:
                total += current * _SCALES[w]
                current = 0
        last = w
    return total + current


# What a sign may stand before: a number in digits or a \\frac (and \u221e, \\infty or the word infinity: "\u2014\u221e"
# and "minus infinity" are -\\infty)
_SIGNABLE = r"(?=\.?\d|\\[dt]?frac|\\infty(?![A-Za-z])|\u221e|(?i:infinity)(?!\w))"
# LaTeX's relations, arrows and binary operators: after one a minus is a sign, as after "=" or "<" ("x\\le-7",
# "2\\times-7", "x \\geq \u2014 7" and "x \\le minus 7" are -7: _GLUED_SIGN, _EM_MINUS, _OPERAND), where after a symbol
# that is an operand (\\pi, \\infty, \\alpha) it is a subtraction ("2\\pi-3" is no -3). A command only as a whole word:
# \\in is not \\infty, \\to not \\top, \\ne not \\nearrow.
_RELATIONS = ("le", "leq", "ge", "geq", "lt", "gt", "ne", "neq", "approx", "equiv", "sim", "simeq", "to", "mapsto",
              "in", "leqslant", "geqslant", "colon", "times", "cdot", "div", "pm", "mp", "ll", "gg", "mid", "gets",
              "rightarrow", "Rightarrow", "longrightarrow", "Longrightarrow", "leftarrow", "Leftarrow", "implies",
              "iff")
_RELATION = r"\\(?:%s)(?![A-Za-z])" % "|".join(_RELATIONS)
_AFTER_RELATION = "|".join(r"(?<=\\%s)" % c for c in _RELATIONS)  # one lookbehind a width, as re reads them
_GLUED_SIGN = re.compile(rf"({_RELATION})-")  # "x\le-7": _NUMBER reads no sign after a letter
# A sign in words: "negative" always; "minus" where it cannot be a subtraction, i.e. not after an operand (a number in
# digits or in words, a single letter, a LaTeX symbol as \\pi, a closing bracket, a percent sign), as the sign "-" is
# read only where it cannot be one: "the answer is minus seven" and "x = minus 7" are -7, "ten minus seven", "12 minus
# 7", "x minus 7" and "x^2 minus 7" are not.
_SIGN_WORD = re.compile(r"\b(negative|minus)\s+" + _SIGNABLE, re.IGNORECASE)  # before digits (words: below)
_OPERAND = re.compile(rf"(?:[\d)\]}}%]|(?<![A-Za-z\\])[A-Za-z]|(?!{_RELATION})\\[A-Za-z]+"
                      rf"|\b(?:{_CARDINAL}|{'|'.join(_DENOMINATORS)})s?)\s*$", re.IGNORECASE)


def _is_sign(text: str, m: re.Match) -> bool:
    """Whether the "negative" or "minus" `m` found at its start in `text` is a sign (see _SIGN_WORD). An operand is a
    short word: the 40 characters before are read, which keeps a long hint of many signs linear."""
    return m[1].lower() == "negative" or _OPERAND.search(text[max(0, m.start() - 40):m.start()]) is None


# An em dash (\u2014) that is a minus: one directly before a number at the start of the hint or after a space, an
# opening bracket or a comma ("the answer is \u20147", "(\u20143, 5)", "[\u20143, 5]", "(3,\u20147)"), and one after
# "=", a comparison sign (<, >, \u2264, \u2265, \u2260) or a LaTeX relation (\\le, \\times: _RELATIONS) whatever the
# spaces ("x = \u2014 7", "x<\u20147", "x \\geq \u2014 7"): no prose writes those. Elsewhere it is punctuation, which it
# mostly is ("the sum\u20147 apples\u2014", "add 7 \u2014 5 is left", "pages 3\u20137"), after a letter too
# ("is\u20147" may be "is 7" set off by a dash): read as a minus everywhere (as _NORMAL reads the en dash),
# "twenty\u2014two" would be 22 and no longer 20 and 2.
_EM_MINUS = re.compile(r"(?:^|(?<=[\s(\[{,]))\u2014" + _SIGNABLE
                       + rf"|(?:(?<=[=<>\u2264\u2265\u2260])|{_AFTER_RELATION})\s*\u2014\s*" + _SIGNABLE)


def _signed(hint: str) -> str | None:
    """The hint with each sign in words before a number in digits (or \u221e, _SIGNABLE), and each em dash that is a
    minus (_EM_MINUS), written "-" ("is minus 3/4" is "is -3/4", "is \u20147" is "is -7", "is \u2014\u221e" is
    "is -\u221e"), None where it has none: the guard reads the hint both ways, as "negative five" is -5 and also 5,
    and "is \u20147" -7 and also 7."""
    out = _EM_MINUS.sub("-", _SIGN_WORD.sub(lambda m: "-" if _is_sign(hint, m) else m[0], hint))
    return out if out != hint else None


def _word_values(text: str) -> set[Fraction]:
    """The values of the numbers `text` writes in words (see _WORD_NUMBER), each in every reading: "two thirds" is 2/3
    and also 2, "negative five" and "is minus five" are -5 and also 5 ("ten minus five" is 10 and 5: _is_sign); and
    digits before a scale word ("3 thousand" is 3000)."""
    out: set[Fraction] = set()
    for m in _WORD_NUMBER.finditer(text):
        sign, body, denominator = m.group(1), m.group(2).lower(), m.group(3)
        words = [w for w in re.split(r"[\s-]+", body) if w != "and"]
        article = words[0] == "a"  # "a third": 1/3, and no reading as 1
        if article:
            words = words[1:] or ["one"]
            if words == ["one"] and not denominator:
                continue
        elif words == ["one"] and not denominator:
            continue
        value = _cardinal(words)
        if value is None:  # several numbers in a row (ten and five): each word its own number
            found = {Fraction(_UNITS.get(w, _TENS.get(w))) for w in words if w != "one" and w not in _SCALES}
        else:
            found = set() if article and words == ["one"] else {Fraction(value)}
            if denominator:
                found.add(Fraction(value, _DENOMINATORS[denominator.lower()]))
        if sign and _is_sign(text, m):
            found |= {-v for v in found}
        out |= found
    for m in _SCALED.finditer(text):  # digits and a scale word: "3 thousand" is 3000, "2.5 million" 2500000
        out.add(Fraction(m[1]) * _SCALES[m[2].lower()])
    return out


# A number in scientific notation: 1.2e1, 1.2E+1, 5e-1, and 1.2 \times 10^{1} (also \cdot, \u00d7, \u00b7, *, x or X,
# the x spaced or touching the digits, as in 6.02x10^{23} and as an answer read without spaces has it; and 10^1,
# 10\u00b9): read from the hint as written, as _quantities leaves exponents out. An exponent of at most three digits
# (1e99999 is no hint's answer, and its value would take long to compute).
_SUPERSCRIPT = str.maketrans("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b", "0123456789+-")
_SCIENTIFIC = re.compile(
    r"(?<![\w.])(-?(?:\d+(?:\.\d+)?|\.\d+))(?:[eE]([+-]?\d{1,3})(?!\w|\.\d)"
    r"|\s*(?:\\times|\\cdot|[\u00d7\u00b7*]|(?<=[\s\d])[xX](?=\s|10))\s*10\s*"
    r"(?:\^\s*(?:\{\s*([+-]?\d{1,3})\s*\}|([+-]?\d{1,3})(?!\d))"
    r"|([\u207a\u207b]?[\u2070\u00b9\u00b2\u00b3\u2074-\u2079]{1,3})(?![\u2070\u00b9\u00b2\u00b3\u2074-\u2079])))")


def _scientific_value(m: re.Match) -> Fraction:
    """The value of one number _SCIENTIFIC matched: "1.2e1" is 12."""
    exponent = next(e for e in m.groups()[1:] if e is not None).translate(_SUPERSCRIPT)
    return Fraction(m[1]) * Fraction(10) ** int(exponent)


# x = - 5, x = - \frac{1}{2}, x < - 5, x \le - 5: after =, a comparison sign or a LaTeX relation (_RELATIONS), a
# spaced minus is a sign, not a subtraction (_quantities, _scientific_values)
_SPACED_SIGN = re.compile(rf"((?:[=<>\u2264\u2265\u2260]|{_RELATION})\s*)-\s+(?=\.?\d|\\[dt]?frac)")


def _joined_signs(text: str) -> str:
    """`text` with each minus that is a sign next to its number, as a number is read: "x = - 5" and "x \\le - 5"
    are "x = -5" and "x \\le -5" (_SPACED_SIGN), and set off from a relation it is glued to, "x\\le-5" is
    "x\\le -5" (_GLUED_SIGN)."""
    return _GLUED_SIGN.sub(r"\1 -", _SPACED_SIGN.sub(r"\1-", text))


def _scientific_values(text: str) -> set[Fraction]:
    """The values of the numbers `text` writes in scientific notation (see _SCIENTIFIC): "1.2e1" is 12. Read as
    written and as _clean typesets it, a sign joined to its number (_joined_signs, as _quantities joins it): an answer
    in scientific notation was matched as text in that typesetting before it was read by value, and
    "6.02\\,\\times\\,10^{23}", "6.02 $\\times 10^{23}$" and "x = - 6.02e23" still give it away. A number of over
    1000 digits the thin spaces grouped (1\\,000\\,000...) is none there either (_no_huge)."""
    typeset = _no_huge(_joined_signs(_clean(text)))
    return {_scientific_value(m) for t in (text, typeset) for m in _SCIENTIFIC.finditer(t)}


def _answer_value(answer: str) -> Fraction | None:
    """The answer's value where the answer is one number (17, 9.0, 0.5, 1,234, 3/4, -\\frac{3}{4}, \\frac{-3}{4};
    in scientific notation, 6.02e23, 6.02 \\times 10^{23} and 6.02x10^{23} (or X) as in a hint (_SCIENTIFIC); also with
    LaTeX thin spaces, a percent sign, a degree sign (^\\circ, \\degree or the character \u00b0), an escaped dollar
    sign, LaTeX digit grouping (10{,}000), a unit after it as in 5\\text{ cm} (with its exponent and others after it:
    \\text{ mol}^{-1}, \\mathrm{mol^{-1}}, \\operatorname{mol}^{-1}, \\text{ m}\\cdot\\text{s}^{-2}), inside
    \\text{}, or after a variable as in x = 3), else None. A number of over 1000 digits (_HUGE) is None: matched as
    text."""
    a = re.sub(r"\s", "", _clean(answer)).replace("{,}", ",")  # MATH's 10{,}000, as the reward reads it
    a = re.sub(r"^[a-zA-Z](?:_\{?\w+\}?)?=", "", a)  # x=3, x_1=3
    a = re.sub(r"(?<=[\d}])" + _UNIT + r"(?:(?:\\cdot|/)?" + _UNIT + ")*$", "", a)  # a unit: 5\text{cm}, 3\mathrm{m}^2
    a = re.sub("^" + _TEXT + "$", r"\1", a)  # \text{5}
    if _HUGE.search(a) is not None:  # a huge one: matched as text
        return None
    a = re.sub(r"\\?%|\^\{?\\circ\}?|\u00b0|\\degree|\\(?=[\d-])", "", a)
    if (m := _NUMBER.fullmatch(a)) is not None:
        return _value(m)
    return _scientific_value(m) if (m := _SCIENTIFIC.fullmatch(a)) is not None else None


def _mentions(text: str, answer: str, alone: bool = False) -> bool:
    """`answer` (no spaces) occurs in `text` (spaces anywhere in it allowed), as a token of its own where it starts or
    ends with a letter or digit: answer C is in "option C", not in "Case"; x^2+1 not in x^2+10. A word of two letters
    or more written as a word (a lowercase letter in it) is found in any case (Yes in "the answer is yes"); a single
    letter (a choice, a variable) and capitals (a segment AB, a vertex set) only as they are. `alone`: not after a
    letter, a digit or a closing bracket whatever it starts with (\\pi/4 is not in 3\\pi/4)."""
    pattern = r"\s*".join(map(re.escape, answer))
    if alone:
        pattern = r"(?<![A-Za-z0-9})\]])" + pattern
    elif answer[0].isalnum():
        pattern = r"(?<![A-Za-z0-9])" + pattern
    if answer[-1].isalnum():
        pattern += r"(?![A-Za-z0-9])"
    word = re.fullmatch(r"[A-Za-z]{2,}", answer) is not None and not answer.isupper()
    return re.search(pattern, text, re.IGNORECASE if word else 0) is not None


# What may be a numbered list's label: 1-2 digits and "." or ")" (also "(2)"; bold as in Markdown, **2.**) before a
# word (also an emphasised one, as in "2. **Solve** it"), at the start of the hint or of a line (clean_hint keeps a
# list item on its own line) or after a sentence's end.
_LIST_LABEL = re.compile(r"(?:(?P<line>^)|(?<=[.!?]\s))[ \t]*(?:\*\*|__)?\(?(?P<n>\d{1,2})[.)](?:\*\*|__)?"
                         r"(?=[ \t]+[*_]*[A-Za-z])", re.MULTILINE)


def _drop_list_labels(hint: str) -> str:
    """The hint less its list labels: a run of at least two, a 1 at the start of a line, then each next number (2
    after 1, 3 after 2) where _LIST_LABEL may find a label. Only a list counts, so "The total is 2. Check it.", "Add:
    2. Then double", "Add 7 and 5. 12. Then halve it" and a lone "The probability equals\n1. So it is certain." keep
    their quantities."""
    last, runs = 0, []  # runs: the label matches of each list found
    for m in _LIST_LABEL.finditer(hint):
        n = int(m["n"])
        if n == 1 and m["line"] is not None:
            runs.append([m])
        elif last and n == last + 1:
            runs[-1].append(m)
        else:
            continue
        last = n
    for m in reversed([m for run in runs if len(run) >= 2 for m in run]):  # a lone "1." is no list
        hint = hint[:m.start()] + hint[m.end():]
    return hint


def _quantities(hint: str) -> str:
    """The hint as the numeric leak check reads it: a spaced sign after = joined to its number, digit grouping written
    with commas (LaTeX's 10{,}000, 10,\\!000 and 10\\,000, and 10 000 with a space, are 10,000), and the numbers
    that name no quantity left out: exponents and subscripts (x^2, 3^{4}, a_1), step numbers (Step 2:, **Step 2**,
    STEP 2., ### Step 2, after step 2), case and part labels (Case 1:, Part 2.), the level a hint request names, as a
    hint's title echoes it (Level 2 hint:, Hint (level 2):, Level 2 (medium):, as the request describes it), and list
    labels (1. Let n be ...)."""
    h = _drop_list_labels(hint)
    h = _joined_signs(h)  # x = - 5 and x\le-5 are -5: a minus after = or \le is a sign
    h = re.sub(r"\{,\}", ",", h)
    h = re.sub(r"(?<=\d),?\\[,!;: ]\s*(?=\d{3}(?!\d))", ",", h)
    h = re.sub(r"[\^_]\s*(?:\{[^{}]*\}|-?\d+(?:\.\d+)?)", "p", h)  # a letter: x^2-4 stays a subtraction
    # digits grouped by a space (10 000; also the no-break, figure, thin and narrow no-break spaces of typesetting) as
    # 10,000, and so also still as 10 and 000: groups of exactly three digits after a first of one to three, so "10
    # 0000", "1234 567" and "10 000x" are no grouping; six groups at most, so "100 100 100 ..." repeated is no number
    # of thousands of digits (which Python will not read)
    h = re.sub(r"(?<![\w.,])\d{1,3}(?:[ \u00a0\u2007\u2009\u202f]\d{3}){1,6}(?!\w)",
               lambda m: re.sub(r"\D", ",", m[0]), h)
    # a label (Step 2:, **Step 2**: in Markdown, ### Step 2, Step 2 - add, after step 2 you have), not 5 steps 20 times
    h = re.sub(r"\b(step)\s+\d+(?!\d|[.,]\d|/)", r"\1", h, flags=re.IGNORECASE)
    h = re.sub(r"\b(case|part)\s+\d+\s*(?=[*_]+|[:.),])", r"\1", h, flags=re.IGNORECASE)  # Case 1: n is even
    return re.sub(r"\b(level)\s+[1-3]\b(?=[\s*_]*(?:hint\b|[):\]]|[(,\u2013\u2014-]\s*(?:minimal|medium|detailed)\b))",
                  r"\1", h, flags=re.IGNORECASE)


def leaks(hint: str, answer: str) -> bool:
    """True when the hint reveals the final answer: it contains a \\boxed{} answer, or the gold answer itself. A
    numeric answer is matched by value in any form a number is written in (9 and 9.0; 0.5, 1/2, \\frac{1}{2} and
    50%; 5/2 and 2\\frac{1}{2}; 1234 and 1,234; 1.2e1 and 1.2 \\times 10^1 as 12, in the answer too; 5\\text{ cm} as
    5; forty-two, two thirds, negative five in words; minus 5 as a sign) as a standalone number: "19" does not reveal
    9, and "12 - 3" is a step, not the answer. Any other answer is matched as text in one typesetting (spaces, $ and
    \\text{} wrappers dropped), as a token of its own where it starts or ends with a letter or digit. Both are read
    after _normal (a vulgar fraction, the full-width forms, the dashes and invisible characters)."""
    hint, answer = _normal(hint), _normal(str(answer))
    if "\\boxed" in hint:
        return True
    value = _answer_value(answer)
    if value is not None:
        few = _no_huge(hint)  # _values drops them itself, after _quantities has joined LaTeX's digit groups
        found = _values(_quantities(hint)) | _word_values(few) | _scientific_values(few)
        if (signed := _signed(hint)) is not None:  # "minus 7" and "is \u20147" are -7, and also 7
            found |= _values(_quantities(signed)) | _scientific_values(_no_huge(signed))
        return value in found or "%" in answer and value / 100 in found  # 17% is also 0.17
    ans = re.sub(r"\s", "", re.sub(_TEXT, r"\1", _clean(answer)))
    ans = re.sub(r"^\((\w)\)$", r"\1", ans)  # a choice: (C) is also written C
    # "is \u2014\u221e" is -\infty, and also \infty; "(\u20143, 5)" is (-3, 5), and also (\u20143, 5)
    return bool(ans) and any(_names(reading, ans) for reading in (hint, _signed(hint)) if reading is not None)


def _names(hint: str, ans: str) -> bool:
    """Whether the hint writes `ans`, an answer that is no number (typeset as leaks() reads it), as text."""
    text = re.sub(_TEXT, r"\1", _clean(hint))
    if ans == "A":  # the choice A, not the article: "A good first step" is no leak, "(A)" and "A is right" are
        text = re.sub(r"\bA(?=\s+[a-z])(?!\s+is\b)", " ", text)
    return _mentions(text, ans) or any(_mentions(text, s, alone=True) for s in _slashed(ans))


def _slashed(ans: str) -> set[str]:
    """A fraction answer as a hint may write it inline: \\frac{\\pi}{4} as \\pi/4, \\frac{x+1}{2} as (x+1)/2 (a part
    with a + or - only in parentheses); none for another answer."""
    group = r"\{((?:[^{}]|\{[^{}]*\})+)\}"
    m = re.fullmatch(r"(-?)\\frac" + group + group, ans)
    if m is None:
        return set()
    sign, num, den = m.groups()
    forms = [{f"({part})"} | (set() if re.search(r"(?<=.)[-+]", part) else {part}) for part in (num, den)]
    return {f"{sign}{a}/{b}" for a in forms[0] for b in forms[1]}


def clean_hint(text: str) -> str:
    """The hint as written, whitespace stripped: its first six non-empty lines, joined by spaces (a hint cut at
    hint_max_tokens keeps its last, unfinished words), except that an item of a numbered list keeps its own line: the
    leak guard reads its label (1., 2)) as a label, not as a quantity, also where the item before ends without a
    period. A line that only starts like an item ("1. So it is certain." after "The probability equals") keeps its
    line too: the guard takes labels only in a run of two or more (_drop_list_labels), so a lone one stays a
    quantity either way."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][:6]
    return "".join(("\n" if i and _LIST_LABEL.match(ln) else " " if i else "") + ln for i, ln in enumerate(lines))


def request_prompt(req: HintRequest) -> list[dict]:
    """The chat prompt asking for a hint. With no reference solution the hint is written from the problem alone."""
    return chat(hint_request(req.problem, req.solution or "(not available)", req.level))


# ----------------------------------------------------------------------------------------------- sources
class HintSource:
    name = "base"

    def prepare(self, rows: Sequence[dict], ctx: HintContext) -> None:
        """Called once before the first update (fixed hints are written here)."""

    def start_over(self, delete: bool = True) -> None:
        """The run starts over in an output dir that may hold an earlier run's files (not a resume): forget what was
        read from them, and delete them (`delete`: one process does). Sources that keep nothing on disk: no-op."""

    def get(self, requests: Sequence[HintRequest], ctx: HintContext) -> list[HintResult]:
        raise NotImplementedError


def sample_hints(requests: Sequence[HintRequest], ctx: HintContext) -> list[HintResult]:
    """Ask the model for each hint (at ctx.temperature); resample the ones that leaked or came back empty, up to
    ctx.retries times (at ctx.retry_temperature). One the model gave no answer to (None: the endpoint is down, it
    was tried there already) fails at once: asking again would only wait on it again. Always makes 1 + retries
    generate calls (some maybe empty), so every process makes the same calls."""
    results = [HintResult(None) for _ in requests]
    unanswered: set[int] = set()
    for attempt in range(1 + ctx.retries):
        todo = [i for i, r in enumerate(results) if r.text is None and i not in unanswered]
        temperature = ctx.temperature if attempt == 0 else ctx.retry_temperature
        texts = ctx.generate([request_prompt(requests[i]) for i in todo], ctx.max_new_tokens, temperature)
        for i, raw in zip(todo, texts, strict=True):
            results[i].attempts += 1
            if raw is None:
                unanswered.add(i)
                results[i].unanswered = True
                continue
            text = clean_hint(raw)
            if not text:
                continue
            if leaks(text, requests[i].answer):
                results[i].leaked = True
                continue
            results[i].text = text
    return results


class OnlineHints(HintSource):
    """The current policy writes each hint when it is needed (no caching across steps)."""

    name = "online"

    def get(self, requests, ctx):
        return sample_hints(requests, ctx)


class CachedHints(HintSource):
    """Hints looked up by (prompt_id, level); a missing one is a failure, never a silent empty hint."""

    def __init__(self, hints: dict[tuple[str, int], str] | None = None):
        self.hints = dict(hints or {})
        self.leaked: set[tuple[str, int]] = set()

    def get(self, requests, ctx):
        out = []
        for r in requests:
            text = self.hints.get((r.prompt_id, r.level))
            if text is not None and leaks(text, r.answer):
                self.leaked.add((r.prompt_id, r.level))
                out.append(HintResult(None, leaked=True, attempts=1))
            else:
                out.append(HintResult(text, leaked=(r.prompt_id, r.level) in self.leaked, attempts=1))
        return out


FIXED_HINTS_FILE = "fixed_hints.jsonl"  # in a run's output dir


class FixedHints(CachedHints):
    """Hints written once by the initial policy for every prompt and level, persisted to `path` (JSONL), and the
    (prompt, level) pairs where a sample leaked to `<stem>_leaked.json`. Existing files are reused, so a resumed
    run keeps the hints of its initial policy and reports the same leaks."""

    name = "fixed"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        super().__init__(read_hints(self.path) if self.path.exists() else {})
        if self.path.exists() and self.leaks_path.exists():
            self.leaked = {(str(pid), int(lvl)) for pid, lvl in json.loads(self.leaks_path.read_text())}

    @property
    def leaks_path(self) -> Path:
        return self.path.with_name(f"{self.path.stem}_leaked.json")

    def start_over(self, delete: bool = True) -> None:
        """Forget the hints and leaks read from the files, and delete the files (`delete`: one process does): a run
        that starts over has its initial policy write them again."""
        self.hints, self.leaked = {}, set()
        for p in (self.path, self.leaks_path) if delete else ():
            p.unlink(missing_ok=True)

    def prepare(self, rows, ctx):
        # written once, by the initial policy: files there (even with no usable hint: every sample leaked) are its
        # hints; a resumed run must not have its trained policy write them. Decided on every process together
        if all(ctx.gather([bool(self.hints) or self.path.exists()])):
            return
        mine = [row for i, row in enumerate(rows) if i % ctx.world == ctx.rank]
        reqs = [HintRequest(r["prompt_id"], r["problem"], r.get("solution", ""), r["answer"], lvl)
                for r in mine for lvl in LEVELS]
        results = sample_hints(reqs, ctx)
        local = [(q.prompt_id, q.level, res.text, res.leaked) for q, res in zip(reqs, results, strict=True)]
        for pid, lvl, text, leaked in ctx.gather(local):
            if text is not None:
                self.hints[(pid, lvl)] = text
            if leaked:
                self.leaked.add((pid, lvl))
        if ctx.rank == 0:  # the leaks first: a hints file is only there with its leaks next to it
            self.leaks_path.parent.mkdir(parents=True, exist_ok=True)
            self.leaks_path.write_text(json.dumps(sorted(self.leaked)))
            write_hints(self.path, [(p, lvl, t) for (p, lvl), t in self.hints.items()])
        log.info("fixed hints: %d written by the initial policy to %s", len(self.hints), self.path)


class TeacherHints(CachedHints):
    """Hints from another model. `teacher` is a hints file (.jsonl/.parquet with prompt_id, level, hint and, where
    `sage hints` wrote it, problem_sha), an OpenAI-compatible base URL (http[s]://host/v1; `model` names the served
    model; checked when the source is built, see _check_endpoint, unless `check` is False: a run that is done and
    trains nothing need not reach it; an API key from SAGE_TEACHER_API_KEY), or a local model path."""

    name = "teacher"

    def __init__(self, teacher: str, model: str | None = None, max_new_tokens: int = 256, check: bool = True):
        super().__init__()
        self.teacher, self.model, self.max_new_tokens = teacher, model, max_new_tokens
        self._generate: GenerateFn | None = None
        self.file: Path | None = None
        self.variants: HintVariants = {}  # the file's hints by problem_sha (prepare picks the training problems')
        if is_hints_file(teacher):
            self.file = Path(teacher).expanduser()
            if not self.file.is_file():
                raise MissingDataFile(f"teacher hints file not found: {self.file}"
                                      + (" (a folder)" if self.file.is_dir() else ""))
            try:
                self.variants = read_hint_variants(self.file)
            except DataError as e:
                raise DataError(f"teacher hints file {e}") from None
            self.hints = pick_hints(self.variants)[0]
        elif teacher.startswith(("http://", "https://")):
            self._generate = _openai_generate(teacher, model, check=check)
        else:  # checked now, loaded when the first hint is asked for (never before the policy)
            self._generate = _local_model_generate(teacher)

    def prepare(self, rows, ctx):
        """A hints file is matched to the training prompts by prompt id, and ids can repeat across data sets
        (synthetic ids do not name the difficulty): drop the hints whose problem_sha names another problem, refuse
        a file that covers none of the training prompts (the run would be GRPO under a SAGE label), and warn about
        one that covers less than half."""
        if self.file is None:
            return
        want = {str(r["prompt_id"]): problem_sha(r["problem"]) for r in rows}
        self.hints, stale = pick_hints(self.variants, want)
        stale = [k for k in stale if k[0] in want]
        if stale:
            log.warning("%s: %d hints were written for another problem under the same prompt id (their problem_sha "
                        "differs); they are ignored", self.file, len(stale))
        covered = len(want.keys() & {pid for pid, _ in self.hints})
        if want and not covered:
            ids = sorted({pid for pid, _ in self.hints} | {pid for pid, _ in stale})
            raise DataError(f"{self.file}: its hints cover none of the {len(want)} training prompts (it has hints "
                            f"for {len(ids)} prompt ids, e.g. {ids[:3]}; training ids are e.g. {list(want)[:3]}"
                            + (f"; {len(stale)} hints were written for other problems under the same ids"
                               if stale else "") + "); write hints for this spec with `sage hints`")
        if covered < len(want) / 2:
            log.warning("%s: its hints cover %d of the %d training prompts; the others get no hint", self.file,
                        covered, len(want))

    def get(self, requests, ctx):
        unanswered: set[tuple[str, int]] = set()  # asked now and not answered: failed, whatever leaked before
        if self._generate is not None:
            missing = [r for r in requests if (r.prompt_id, r.level) not in self.hints]
            if missing:  # the teacher is fixed, so its hints are cached
                teacher_ctx = HintContext(generate=self._generate, max_new_tokens=self.max_new_tokens,
                                          retries=ctx.retries, temperature=ctx.temperature,
                                          retry_temperature=ctx.retry_temperature)
                for r, res in zip(missing, sample_hints(missing, teacher_ctx), strict=True):
                    if res.text is not None:
                        self.hints[(r.prompt_id, r.level)] = res.text
                    if res.leaked:
                        self.leaked.add((r.prompt_id, r.level))
                    if res.unanswered:
                        unanswered.add((r.prompt_id, r.level))
        out = super().get(requests, ctx)
        for r, res in zip(requests, out, strict=True):
            res.unanswered = (r.prompt_id, r.level) in unanswered
        return out


class TeacherError(RuntimeError):
    """The teacher endpoint cannot write hints for a reason retrying cannot mend (nothing listens at the URL, a wrong
    model name, a missing or refused API key)."""


TEACHER_CONCURRENCY = 16  # requests in flight to an OpenAI-compatible teacher (a vLLM server batches them)
TEACHER_ATTEMPTS = 3  # tries of one request on a transient failure (no connection, 429, 5xx, a reply that is no
# chat completion, as a proxy's HTML page)
TEACHER_TIMEOUT = 120.0  # seconds one hint request may take, its tries included: a hung or trickling server is cut off
TEACHER_PROBE_TIMEOUT = 10.0  # seconds for each try of the check made when the source is built
TEACHER_STARTUP_WAIT = 600.0  # seconds the check waits for an endpoint still starting (no connection yet, 429,
# 502/503/504 as llama.cpp's "Loading model"): `vllm serve` of a 72B model started beside `sage launch` loads for
# minutes. STARTUP_WAIT_VAR overrides it (0: one try)
STARTUP_WAIT_VAR = "SAGE_TEACHER_STARTUP_WAIT"
TEACHER_STARTUP_POLL = 5.0  # seconds between two tries of an endpoint still starting
TEACHER_STARTUP_LOG = 30.0  # seconds between two "waiting for the teacher" lines
TEACHER_KEY_VAR = "SAGE_TEACHER_API_KEY"  # the endpoint's API key; never OPENAI_API_KEY: a user's OpenAI key is not
# sent to whatever URL a spec names as its teacher (plain http included)


def _teacher_key() -> str | None:
    """The API key sent to a teacher endpoint as a bearer token (TEACHER_KEY_VAR); None where it is not set. Read from
    the environment only, so a key never goes into a spec, its spec.json, a log or MLflow."""
    return os.environ.get(TEACHER_KEY_VAR, "").strip() or None


def _startup_wait() -> float:
    """Seconds the endpoint check waits for a server still starting: STARTUP_WAIT_VAR where set, else
    TEACHER_STARTUP_WAIT. Raises TeacherError for a value that is no number >= 0."""
    raw = os.environ.get(STARTUP_WAIT_VAR, "").strip()
    if not raw:
        return TEACHER_STARTUP_WAIT
    try:
        wait = float(raw)
    except ValueError:
        wait = float("nan")
    if not wait >= 0:
        raise TeacherError(f"{STARTUP_WAIT_VAR}={raw!r}: the seconds to wait for a teacher endpoint still starting, a "
                           "number >= 0 (0: one try)")
    return wait


def _send(client, method: str, url: str, deadline: float, body: dict | None = None) -> tuple[int, str, str | None]:
    """One HTTP request's status, text and Location header (redirects are not followed), cut off at `deadline`
    (time.monotonic()): httpx's timeout bounds each read alone, so a server that trickles its reply (its head
    included) would hold the request for ever. The body is read chunk by chunk against the deadline; before the head
    is whole, a timer shuts the request's socket down at the deadline (the client keeps no idle connection, so each
    request opens its own, and httpx's trace extension names its network stream). Raises an httpx.TransportError
    (httpx.ReadTimeout past the deadline)."""
    import socket

    import httpx

    left = deadline - time.monotonic()
    if left <= 0:
        raise httpx.TimeoutException("no time left")
    streams = []

    def trace(event: str, info: dict) -> None:
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            streams.append(info["return_value"])

    def cut() -> None:
        for stream in streams:
            with contextlib.suppress(OSError, AttributeError):
                # the plain socket's shutdown: an SSLSocket's own also unsets the SSL object the reading thread uses
                socket.socket.shutdown(stream.get_extra_info("socket"), socket.SHUT_RDWR)

    timer = threading.Timer(left, cut)
    timer.daemon = True
    timer.start()
    try:
        with client.stream(method, url, json=body, timeout=left, extensions={"trace": trace}) as resp:
            data = bytearray()
            for chunk in resp.iter_bytes():
                data += chunk
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the reply was still coming at the deadline")
            return resp.status_code, data.decode(errors="replace"), resp.headers.get("location")
    except httpx.TransportError as e:
        if time.monotonic() >= deadline and not isinstance(e, httpx.TimeoutException):  # cut by the timer
            raise httpx.ReadTimeout("the reply was still coming at the deadline") from e
        raise
    finally:
        timer.cancel()


def _teacher_client(headers: dict | None = None):
    """The httpx client of a teacher endpoint: no idle connection is kept, so that each request has a socket of its
    own that _send can shut down at its deadline (a connection a request reuses opens before it: its trace shows no
    stream)."""
    import httpx

    return httpx.Client(headers=headers, limits=httpx.Limits(max_keepalive_connections=0))


# how servers word a request over their context (HTTP 400): vLLM and OpenAI "maximum context length", llama.cpp
# "exceeds the available context size", SGLang "longer than the model's context length"
_OVER_CONTEXT = re.compile(r"context (?:length|size|window)", re.IGNORECASE)


def _completion(text: str) -> str:
    """The content of a chat completion reply ('' for a null one). Raises ValueError, KeyError, IndexError or
    TypeError for a reply that is none (a proxy's HTML page, a login page, a cut reply, no choices)."""
    content = json.loads(text)["choices"][0]["message"]["content"]
    if not isinstance(content, str | None):
        raise TypeError(type(content).__name__)
    return content or ""


def _refusal(url: str, base_url: str, model: str | None, status: int, text: str,
             served: list[str] | None = None) -> TeacherError:
    """The error for a request the endpoint refused (a 4xx): what to change, by what the refusal says."""
    said = f"teacher endpoint {url} refused the request: HTTP {status}: {text[:300]}"
    if status in (401, 403):
        return TeacherError(f"{said} (the endpoint's API key is read from {TEACHER_KEY_VAR}: is it the right key?)"
                            if _teacher_key() else f"{said} (the endpoint wants an API key: set {TEACHER_KEY_VAR} to "
                            "it; OPENAI_API_KEY is never sent to a teacher)")
    if served is not None:
        return TeacherError(f"{said} (the endpoint serves {served}, not {model or 'default'!r}"
                            + ("" if model else ", sent because teacher_model is not set")
                            + ": set teacher_model to one of them)")
    if status == 404 and "model" not in text.lower():  # no such path, not no such model
        return TeacherError(f"{said} (no chat completions at that URL: the teacher URL is the OpenAI-compatible base "
                            f"URL, which ends in /v1, e.g. http://host:8000/v1; got {base_url})")
    return TeacherError(f"{said} (model {model or 'default'!r}; set teacher_model to the served model's name)")


def _redirect(url: str, base_url: str, path: str, status: int, location: str | None) -> TeacherError:
    """The error for an endpoint that redirects (an http -> https redirect, an ingress, a login page): requests are
    not followed there (a POST would be lost, a key sent elsewhere), so the teacher URL must be the one it names."""
    from urllib.parse import urljoin

    if not location:
        return TeacherError(f"teacher endpoint {base_url} redirects {url} (HTTP {status}) without saying where (no "
                            "Location header): give the server's own OpenAI-compatible URL, ending in /v1")
    to = urljoin(url, location)
    return TeacherError(f"teacher endpoint {base_url}: the endpoint redirects to {to} (HTTP {status} for {url}): "
                        + (f"give that URL: teacher={to.removesuffix(path)}" if to.endswith(path) else
                           "not to the same API path (a login page, a proxy in front of the server?): give the "
                           "server's own OpenAI-compatible URL, ending in /v1"))


def _served_models(text: str) -> list[str] | None:
    """The model ids in a /models reply ({"data": [{"id": ...}, ...]}); None for a reply that lists none."""
    try:
        ids = [m["id"] for m in json.loads(text)["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        return None
    return ids or None


def _check_endpoint(client, base_url: str, model: str | None) -> None:
    """Asked once when the source is built, before the policy loads: an endpoint that is not there, wants another
    API key, does not serve `model`, redirects elsewhere or answers with no chat completion (a login page) would
    otherwise turn the run into GRPO with every hint failed. GET /models names the served models; where it cannot
    (no such path, a redirect) or does not list `model`, a one-token chat completion decides (a server that takes any
    name passes). A server still starting (no connection, no answer in time, 429, 502, 503, 504) is asked again every
    TEACHER_STARTUP_POLL seconds for up to _startup_wait() seconds, saying so every TEACHER_STARTUP_LOG seconds;
    other replies are answers. Raises TeacherError saying what to change."""
    import httpx

    base, want, wait = base_url.rstrip("/"), model or "default", _startup_wait()

    def ask(method: str, path: str, body: dict | None = None) -> tuple[int, str, str | None]:
        start, said, tries, logged = time.monotonic(), "", 0, None
        while True:
            tries += 1
            try:
                reply = _send(client, method, base + path, time.monotonic() + TEACHER_PROBE_TIMEOUT, body)
            except httpx.TransportError as e:
                said = f"{type(e).__name__}: {e}"
            else:
                if reply[0] not in (429, 502, 503, 504):
                    return reply
                said = f"HTTP {reply[0]}: {reply[1][:200]}"
            waited = time.monotonic() - start
            if waited >= wait:
                break
            if logged is None or time.monotonic() - logged >= TEACHER_STARTUP_LOG:
                log.warning("waiting for the teacher at %s (%s) ... %.0fs of up to %gs (%s)", base_url, said, waited,
                            wait, STARTUP_WAIT_VAR)
                logged = time.monotonic()
            time.sleep(min(TEACHER_STARTUP_POLL, wait - waited))
        raise TeacherError(f"teacher endpoint {base_url} gives no answer to {method} {base + path} (waited "
                           f"{waited:.0f}s for a server still starting, {tries} tr{'y' if tries == 1 else 'ies'}, the "
                           f"last: {said}; {STARTUP_WAIT_VAR}={wait:g} sets how many seconds): is the server up, and "
                           "at that host and port?")

    status, text, _ = ask("GET", "/models")
    if status in (401, 403):
        raise _refusal(base + "/models", base_url, model, status, text)
    served = _served_models(text) if 200 <= status < 300 else None
    if served is not None and want in served:
        return
    status, text, location = ask("POST", "/chat/completions",
                                 {"model": want, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                  "temperature": 0.0})
    if 300 <= status < 400:
        raise _redirect(base + "/chat/completions", base_url, "/chat/completions", status, location)
    if status >= 500:
        raise TeacherError(f"teacher endpoint {base_url} fails a one-token chat completion: HTTP {status}: "
                           f"{text[:300]}")
    if status >= 400:
        raise _refusal(base + "/chat/completions", base_url, model, status, text,
                       served if status in (400, 404) else None)
    try:
        _completion(text)
    except (ValueError, KeyError, IndexError, TypeError):
        raise TeacherError(f"teacher endpoint {base_url} answers a one-token chat completion with HTTP {status} and "
                           f"no chat completion: {text[:300]!r} (a login page, a proxy in front of the server? the "
                           "teacher URL is the server's own OpenAI-compatible base URL, ending in /v1)") from None


@dataclass
class _Call:
    """One generate call's requests to the endpoint. The first `wave` go out at once; the others wait until one is
    answered (then all go, `concurrency` at a time) or the whole first wave is done: where it all went unanswered
    (the endpoint is down or hung) and none was answered, the others fail without being sent, so a hung server costs
    one deadline a call, not one for each wave of requests."""

    wave: int
    gave_up: int = 0
    skipped: int = 0
    done: int = 0  # requests of the first wave finished (answered, given up, or raised)
    answered: bool = False
    last: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    go: threading.Event = field(default_factory=threading.Event)  # the others may start

    @property
    def dead(self) -> bool:
        return not self.answered and self.gave_up >= self.wave

    def answer(self) -> None:
        self.answered = True
        self.go.set()

    def give_up(self, reason: str) -> None:
        with self.lock:
            self.gave_up += 1
            self.last = reason

    def finished(self, i: int) -> None:
        """Request `i` is over (in a finally: also when it raised, so the others never wait for ever)."""
        if i < self.wave:
            with self.lock:
                self.done += 1
                if self.done >= self.wave:
                    self.go.set()

    def skip(self, i: int) -> bool:
        """True (and counted) when request `i` is not to be sent; a request beyond the first wave waits for `go`."""
        if i >= self.wave:
            self.go.wait()
        with self.lock:
            self.skipped += self.dead
            return self.dead


def _openai_generate(base_url: str, model: str | None, concurrency: int = TEACHER_CONCURRENCY,
                     attempts: int = TEACHER_ATTEMPTS, backoff: float = 1.0,
                     timeout: float = TEACHER_TIMEOUT, check: bool = True) -> GenerateFn:
    """Chat completions from an OpenAI-compatible endpoint, `concurrency` requests at a time, with the API key of
    _teacher_key as a bearer token; the endpoint is checked first (_check_endpoint). A transient failure is retried
    (`attempts` tries, waiting backoff, 2 x backoff, ...; `timeout` seconds for a request, its tries included); one
    that persists gives None, a failed hint the hint sampler does not ask again for (an empty reply is resampled):
    training goes on without it, on every process alike, as does one the server refuses as longer than its context
    (not retried). Where the first wave of a call's requests all go unanswered, the rest of that call fail unsent
    (_Call), and the endpoint is taken for dead: each later call sends one request first and the others only once it
    is answered (a server back up is used again). Another refusal that retrying cannot mend (4xx other than 429)
    raises TeacherError naming the status."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    url = base_url.rstrip("/") + "/chat/completions"
    key = _teacher_key()
    client = _teacher_client({"Authorization": f"Bearer {key}"} if key else None)
    if check:
        _check_endpoint(client, base_url, model)
    too_long: list[int] = []  # requests the server found over its context (warned about once)
    too_long_lock = threading.Lock()
    dead_since: float | None = None  # when a whole call last went unanswered (None: the endpoint answers)

    def ask(messages: list[dict], max_new_tokens: int, temperature: float, call: _Call) -> str | None:
        deadline, last = time.monotonic() + timeout, ""
        body = {"model": model or "default", "messages": messages, "max_tokens": max_new_tokens,
                "temperature": temperature}
        for attempt in range(attempts):
            if attempt:
                wait = backoff * 2 ** (attempt - 1)
                if call.dead or time.monotonic() + wait >= deadline:
                    break
                time.sleep(wait)
            try:
                status, text, location = _send(client, "POST", url, deadline, body)
            except httpx.TransportError as e:  # no connection, no whole reply in time
                last = f"{type(e).__name__}: {e}"
                continue
            if status == 429 or status >= 500:
                last = f"HTTP {status}"
                continue
            if status == 400 and _OVER_CONTEXT.search(text):
                # a request (problem, solution and max_tokens) over the served context: this request's failure, as
                # a policy hint request without room is (not the teacher's)
                call.answer()
                with too_long_lock:  # requests in flight together: the first one warns
                    too_long.append(1)
                    first = len(too_long) == 1
                if first:
                    log.warning("teacher endpoint %s: a hint request does not fit the served model's context (%s); "
                                "such hints count as failed (serve it with a larger --max-model-len, or lower "
                                "hint_max_tokens)", url, text[:200])
                return None
            if status >= 400:
                raise _refusal(url, base_url, model, status, text)
            if status >= 300:  # the check found none: a redirect set up since, as a 5xx
                last = f"HTTP {status}, a redirect to {location}"
                continue
            try:  # a proxy's HTML page, a cut reply, no choices: as a 5xx
                content = _completion(text)
            except (ValueError, KeyError, IndexError, TypeError) as e:
                last = f"HTTP {status}, not a chat completion ({type(e).__name__}): {text[:100]!r}"
                continue
            call.answer()
            return content
        call.give_up(last or f"no whole reply in {timeout:g}s")
        return None

    def one(i: int, messages: list[dict], max_new_tokens: int, temperature: float, call: _Call) -> str | None:
        try:
            return None if call.skip(i) else ask(messages, max_new_tokens, temperature, call)
        finally:
            call.finished(i)

    def generate(prompts, max_new_tokens, temperature):
        nonlocal dead_since
        if not prompts:
            return []
        threads = min(concurrency, len(prompts))
        was_dead = dead_since
        call = _Call(wave=1 if was_dead is not None else threads)
        with ThreadPoolExecutor(threads) as pool:
            out = list(pool.map(lambda im: one(*im, max_new_tokens, temperature, call), enumerate(prompts)))
        if call.dead:
            dead_since = time.monotonic() if dead_since is None else dead_since
        else:
            dead_since = None
        if call.gave_up or call.skipped:  # once a call, not once a request
            if not call.skipped:
                why = ""
            elif was_dead is not None:
                why = (f"; it has answered no call for {time.monotonic() - was_dead:.0f}s, so one request was sent "
                       f"first and, unanswered, the {call.skipped} others were not sent")
            else:
                why = f"; the first {call.wave} all went unanswered, so {call.skipped} were not sent"
            log.warning("teacher endpoint %s: %d of %d hint requests got no answer (each tried up to %d times within "
                        "%gs; the last failure: %s)%s; those hints count as failed", url, call.gave_up + call.skipped,
                        len(prompts), attempts, timeout, call.last, why)
        return out

    return generate


def _local_model_generate(path: str) -> GenerateFn:
    """Hints from a local (or Hugging Face) model: the path is checked at once (check_teacher_model), the model is
    loaded on the first call, so a run builds its hint source before its policy and loads the teacher after it."""
    from .evaluate import generate_hf, render_prompt
    from .models import ModelNotFound, check_chat_template, load_policy

    name = check_teacher_model(path)
    loaded: list = []
    calls = itertools.count()  # a sampling seed per call: a resample after a leak must not repeat the first

    def generate(prompts, max_new_tokens, temperature):
        if not loaded:
            try:
                model, tok = load_policy(name)
                if getattr(tok, "chat_template", None):  # one refusing a lone user turn: jinja's traceback below
                    check_chat_template(tok, name, {"a hint request": prompts[0]})
                loaded.extend((model, tok))
            except ModelNotFound as e:
                raise type(e)(f"teacher: {e}") from e
        model, tok = loaded
        texts = [render_prompt(tok, {"prompt": p}) for p in prompts]
        return [c[0] for c in generate_hf(model, tok, texts, k=1, temperature=temperature, top_p=1.0,
                                          max_new_tokens=max_new_tokens, seed=next(calls))]

    return generate


HINTS_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def teacher_label(teacher: str, model: str | None = None) -> str:
    """The teacher `sage hints` writes into each row it writes: an endpoint's URL (no trailing /) or a local
    model's absolute path, with the model name asked of an endpoint (teacher_model) where one is given."""
    if teacher.startswith(("http://", "https://")):
        name = teacher.rstrip("/")
    else:
        p = Path(teacher).expanduser()
        name = str(p.resolve()) if p.exists() else teacher
    return f"{name} (model {model})" if model else name


def is_hints_file(teacher: str) -> bool:
    """A teacher given as a hints file (.jsonl, .json or .parquet, in any case) rather than a model or a URL."""
    return not teacher.startswith(("http://", "https://")) and Path(teacher).suffix.lower() in HINTS_FILE_SUFFIXES


def check_teacher_model(path: str) -> str:
    """The teacher model's name to load ('~' expanded), after the cheap checks (no loading): a local path exists, a
    .gguf is a file, a folder holds a config.json or a LoRA adapter. Raises ModelNotFound naming the teacher."""
    from .models import ModelNotFound, _looks_local, check_model_path

    if path in ("tiny", "smollm2") or not _looks_local(path) and not path.lower().endswith(".gguf"):
        return path  # a built-in name, or a Hugging Face id: known only once loaded
    p = Path(path).expanduser()
    try:
        check_model_path(p)
    except ModelNotFound as e:
        raise ModelNotFound(f"teacher {path}: {e}; a teacher may also be a hints file "
                            f"({', '.join(HINTS_FILE_SUFFIXES)}) or an OpenAI-compatible URL "
                            "http[s]://host/v1") from None
    return str(p)


# ----------------------------------------------------------------------------------------------- files
def problem_sha(problem: str) -> str:
    """A short hash of a problem's text, written with each hint by `sage hints`: prompt ids alone can name another
    problem (synthetic ids are the same for every difficulty)."""
    return hashlib.sha256(str(problem).encode()).hexdigest()[:12]


def read_hints(path: Path) -> dict[tuple[str, int], str]:
    """Read a hints file: rows with prompt_id, level (1..3) and hint (see read_hint_variants). Where one prompt id and
    level has hints for several problems (problem_sha), only a hint written without problem_sha is taken."""
    return pick_hints(read_hint_variants(path))[0]


HintVariants = dict[tuple[str, int], dict[str | None, str]]  # (prompt id, level) -> problem_sha or None -> hint


def read_hint_variants(path: Path, records: list[dict] | None = None) -> HintVariants:
    """The hints of a hints file by (prompt id, level), each by the problem_sha its row carries (None: none). One
    file may hold hints for several problems under one prompt id (`sage hints` outputs of several specs joined:
    synthetic ids repeat across difficulties). Bad rows raise a DataError naming the row (counted from 0) or, for a
    line that is not JSON, the line (counted from 1); so do a null prompt id, a level of true/false, a hint that is not
    text (5, a list: it would be used as its repr) and two different hints for one prompt, level and problem. A null
    or blank hint is a missing one (counted in a warning), never an empty hint that would be used. `records`: the
    file's rows where the caller has read them already (`sage hints` reads who wrote each one too), named by `path`."""
    if records is None:
        records, _ = read_records(str(path), "hints")  # .jsonl, .json or .parquet, with the data loader's errors
    out: HintVariants = {}
    blank = 0
    for i, rec in enumerate(records):
        missing = {"prompt_id", "level", "hint"} - set(rec)
        if missing:
            raise DataError(f"{path}: row {i} lacks {sorted(missing)} (has {sorted(rec)})")
        pid = rec["prompt_id"]
        if isinstance(pid, (bool, list, dict)) or _is_blank(pid):
            raise DataError(f"{path}: row {i} has prompt_id {pid!r:.80}; a prompt id is a string or a number")
        try:
            level = int(rec["level"])
            ok = level in LEVELS and level == float(rec["level"]) and not isinstance(rec["level"], bool)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise DataError(f"{path}: row {i} has level {rec['level']!r}; levels are {LEVELS}")
        if _is_blank(rec["hint"]):
            blank += 1
            continue
        if not isinstance(rec["hint"], str):
            raise DataError(f"{path}: row {i} has hint {rec['hint']!r:.80} ({type(rec['hint']).__name__}); a hint is a "
                            "string")
        key, text = (str(pid), level), rec["hint"]
        sha = None if _is_blank(rec.get("problem_sha")) else str(rec["problem_sha"])
        variants = out.setdefault(key, {})
        if variants.setdefault(sha, text) != text:
            raise DataError(f"{path}: row {i} gives prompt {key[0]!r} level {level}"
                            + (f" (problem_sha {sha})" if sha else "") + " a second hint, different from the first "
                            f"({variants[sha][:60]!r}, then {text[:60]!r}); keep one")
    if blank:
        log.warning("%s: %d of %d rows have a null or blank hint; those hints count as missing", path, blank,
                    len(records))
    return out


def pick_hints(variants: HintVariants, shas: dict[str, str] | None = None,
               loose: bool = True) -> tuple[dict[tuple[str, int], str], list[tuple[str, int]]]:
    """One hint per (prompt id, level): for a prompt id `shas` names the problem of, the hint written for that
    problem, else (`loose`) one written without problem_sha; for other ids a hint written without problem_sha, or the
    only one there is. Returns the hints and the keys left out because their hints were written for other problems."""
    hints: dict[tuple[str, int], str] = {}
    stale: list[tuple[str, int]] = []
    for key, by_sha in variants.items():
        want = (shas or {}).get(key[0])
        if want is not None:
            text = by_sha.get(want) or (by_sha.get(None) if loose else None)
        else:
            text = by_sha.get(None) or (next(iter(by_sha.values())) if len(by_sha) == 1 else None)
        if text is not None:
            hints[key] = text
        else:
            stale.append(key)
    return hints, stale


def write_hints(path: Path, hints: Sequence[tuple], shas: dict[str, str] | None = None) -> None:
    """Write a hints file; `shas` (prompt id -> problem_sha) adds to each row the hash of the problem it was
    written for. A row given as (prompt id, level, hint, problem_sha) carries its own problem_sha (None: none), and
    one given as (prompt id, level, hint, problem_sha, teacher) also the teacher that wrote it (teacher_label)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for pid, level, text, *own in hints:
            rec = {"prompt_id": pid, "level": level, "hint": text}
            sha = own[0] if own else (shas or {}).get(pid)
            if sha is not None:
                rec["problem_sha"] = sha
            if len(own) > 1 and own[1] is not None:
                rec["teacher"] = own[1]
            f.write(json.dumps(rec) + "\n")


def write_reference_hints(rows: Sequence[dict], path: str | Path) -> Path:
    """A teacher hints file from the synthetic task's reference hints (a perfect, answer-free teacher)."""
    from .data import reference_hint

    path = Path(path)
    write_hints(path, [(r["prompt_id"], lvl, reference_hint(r, lvl)) for r in rows for lvl in LEVELS],
                {r["prompt_id"]: problem_sha(r["problem"]) for r in rows})
    return path


def make_hint_source(name: str, output_dir: str | Path, teacher: str | None = None,
                     teacher_model: str | None = None, max_new_tokens: int = 48, check: bool = True) -> HintSource:
    """The hint source `name`; `check` False: a teacher endpoint is not asked whether it is up (a run that is done)."""
    if name == "online":
        return OnlineHints()
    if name == "fixed":
        return FixedHints(Path(output_dir) / FIXED_HINTS_FILE)
    if name == "teacher":
        if not teacher:
            raise ValueError("hint_source='teacher' needs `teacher`: a hints file, a model path or an endpoint URL")
        return TeacherHints(teacher, teacher_model, max_new_tokens, check=check)
    raise ValueError(f"unknown hint source {name!r}; choose online, fixed or teacher")
