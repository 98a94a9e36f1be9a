"""Hint sources and the leak guard."""

import contextlib
import json
import time

import pytest

from sage_core.data import DataError
from sage_core.hints import (
    FixedHints,
    HintContext,
    HintRequest,
    OnlineHints,
    TeacherError,
    TeacherHints,
    clean_hint,
    leaks,
    problem_sha,
    read_hint_variants,
    read_hints,
    request_prompt,
    sample_hints,
    write_hints,
)
from sage_core.prompts import hint_request, hinted_problem


def req(pid="p1", level=3, answer="9"):
    return HintRequest(pid, "Ann has 7 coins . She gets 5 more . She gives away 3 .", "7 + 5 = 12 . 12 - 3 = 9 .",
                       answer, level)


@pytest.mark.parametrize("hint,answer,leak", [
    ("7 + 5 = 12 . Then 12 - 3 .", "9", False),
    ("7 + 5 = 12 . 12 - 3 = 9 .", "9", True),
    ("it is 9.0", "9", True),
    ("19 coins", "9", False),
    ("so \\boxed{x}", "4", True),
    ("half: \\frac{1}{2} of it", "\\frac{1}{2}", True),
    ("use the quadratic formula", "x^2", False),
    # a numeric answer by value, in whatever form the hint writes it
    ("it is 1/2 of it", "0.5", True),
    ("half: \\frac{1}{2}", "0.5", True),
    ("0.50 of the cake", "1/2", True),
    ("the value \\dfrac{6}{8}", "\\frac{3}{4}", True),
    ("about 1,234 coins", "1234", True),
    ("about 1234 coins", "1\\,234", True),
    ("about 17% of them", "17\\%", True),
    ("the chance is 50% here", "\\frac{1}{2}", True),
    ("so it is 25\\% of all", "0.25", True),
    ("about 12.5 percent", "\\frac18", True),
    ("the rate is 0.17 here", "17\\%", True),
    ("a 20% discount on 50", "\\frac{1}{2}", False),
    ("the rate is 0.17 here", "17", False),
    ("a 90 degree turn", "90^{\\circ}", True),
    ("a 90 degree turn", "90\u00b0", True),
    ("turn it by 45", "45\\degree", True),
    ("x = -3", "-3", True),
    ("so x = - 3 here", "-3", True),
    ("so $x = - \\frac{3}{4}$ here", "-\\frac{3}{4}", True),
    ("so $x = 1 - \\frac{3}{4}$ here", "-\\frac{3}{4}", False),
    ("so x = \u2212 3 here", "-3", True),
    ("so x = 12 - 3 here", "-3", False),
    # ... but as a standalone number: a larger number, a decimal, a step or a subtraction is not the answer
    ("17.5 coins", "17", False),
    ("0.5 of it", "5", False),
    ("divide 12 / 3", "4", False),
    ("3/4 of 8", "6", False),
    ("12-3 first", "9", False),
    ("12-3 first", "-3", False),
    ("the fraction \\frac{3}{5}", "0.5", False),
    # \frac with one-digit arguments without braces, a decimal without its leading 0
    ("so it is \\frac{1}{2}", "\\frac12", True),
    ("so it is 0.5", "\\frac12", True),
    ("the answer is \\frac12", "\\frac{1}{2}", True),
    ("it is \\dfrac 34 of it", "0.75", True),
    ("it is \\tfrac1{2} of it", "1/2", True),
    ("half: .5 of it", "1/2", True),
    ("it is -.5", "-\\frac12", True),
    ("the fraction \\frac13", "\\frac12", False),
    # a mixed number is its whole and its fraction, and also their sum
    ("it takes 2\\frac{1}{2} hours", "2.5", True),
    ("it takes 2 1/2 hours", "\\frac{5}{2}", True),
    ("so it is 2\\tfrac13 in all", "\\frac{7}{3}", True),
    ("it takes 2\\frac{1}{2} hours", "2", True),
    ("so 2 3/2 in all", "3.5", False),
    # a vulgar fraction character is that fraction (and one number, as \frac{1}{2} is), after a whole number a mixed one
    ("eat \u00bd of the cake", "\\frac{1}{2}", True),
    ("it is \u00be of it", "0.75", True),
    ("so \u2153 of them", "1/3", True),
    ("it takes 2\u00bd hours", "\\frac{5}{2}", True),
    ("it takes 2 \u00bd hours", "2.5", True),
    ("it is 1\u20442 of it", "0.5", True),
    ("so \u2153 of them", "\\frac12", False),
    ("eat \u00bd of the cake", "2", False),
    ("version 1.2.5", "0.5", False),
    # numbers in words: cardinals, fractions, a sign; "one" and "a" alone, ordinals and a number's parts are not it
    ("The answer is forty-two.", "42", True),
    ("so there are Seventeen coins", "17", True),
    ("two hundred and five in all", "205", True),
    ("a hundred in all", "100", True),
    ("take two thirds of the pie", "\\frac{2}{3}", True),
    ("eat a quarter of it", "0.25", True),
    ("it comes to negative five", "-5", True),
    ("add ten and five first", "5", True),
    ("one way is to add first", "1", False),
    ("no one needs a step", "1", False),
    ("eat a quarter of it", "1", False),
    ("the third step is key", "3", False),
    ("ten minus five first", "-5", False),
    ("forty-two apples", "40", False),
    ("someone counts seventy-seven", "7", False),
    # "minus" is a sign where it cannot be a subtraction (not after a number, a letter or a bracket), as "negative" is;
    # a sign in words before digits too
    ("the answer is minus seven", "-7", True),
    ("so x = minus 7 here", "-7", True),
    ("it comes to negative 7", "-7", True),
    ("it comes to negative 7", "7", True),
    ("it is minus 3/4 of it", "-0.75", True),
    ("take ten minus seven first", "-7", False),
    ("take 12 minus 7 first", "-7", False),
    ("so x minus 7 is zero", "-7", False),
    ("Factor x^2 minus 7 first.", "-7", False),
    # digits before a scale word are one number
    ("It is 3 thousand in all.", "3000", True),
    ("about 2 hundred coins", "200", True),
    ("a city of 2.5 million people", "2500000", True),
    ("it costs 4-thousand dollars", "4000", True),
    ("it is 3 thousand in all", "4000", False),
    # scientific notation: e-notation, and times a power of 10 (the exponent is no quantity elsewhere)
    ("so it is 1.2e1 in all", "12", True),
    ("so it is 5E-1 of it", "1/2", True),
    ("so it is 1.2 \\times 10^1 in all", "12", True),
    ("so it is $3 \\cdot 10^{-2}$", "0.03", True),
    ("a mass of 2.5 \u00d7 10\u00b3 kg", "2500", True),
    ("so it is 1.2e1 in all", "1.2", True),
    ("so it is 1.2e1 in all", "1", False),
    ("compute 3 \\times 10 first", "30", False),
    ("Factor 10^2 - 1 first.", "100", False),
    # ... and a gold answer in scientific notation is its value too, in any form the hint writes it in
    ("so it is 6.02 \\times 10^{23} of them", "6.02e23", True),
    ("so it is 602000000000000000000000 of them", "6.02e23", True),
    ("so it is 6.02e23 of them", "6.02 \\times 10^{23}", True),
    ("so it is 6.02 \u00d7 10\u00b2\u00b3 of them", "6.02\\cdot10^{23}", True),
    ("so it is 602,000,000,000,000,000,000,000", "6.02\\times10^{23}", True),
    ("so it is 0.0015 here", "1.5\\times10^{-3}", True),
    ("so it is 1000 m", "1e3\\text{ m}", True),
    ("so it is 6.02e22 of them", "6.02e23", False),
    ("so it is 6.02 of them", "6.02e23", False),
    # ... in the typesetting its text was found in before it was read by value: LaTeX's thin spaces, $ inside, a
    # spaced sign after =; and under a sign in words or an em dash, as a number in digits is
    ("so it is 6.02\\,\\times\\,10^{23} of them", "6.02\\times10^{23}", True),
    ("so it is 1.5\\;\\cdot\\;10^{-3}", "1.5\\cdot10^{-3}", True),
    ("so it is 3\\times 10^{\\,8} m/s", "3\\times10^{8}", True),
    ("about 6.02 $\\times 10^{23}$ of them", "6.02\\times10^{23}", True),
    ("so x = - 6.02 \\times 10^{23} here", "-6.02\\times10^{23}", True),
    ("so it is minus 6.02e23", "-6.02e23", True),
    ("so it is \u20146.02e23", "-6.02e23", True),
    ("so it is 6.02\\,\\times\\,10^{22} of them", "6.02\\times10^{23}", False),
    # ... also one with a bare x for the times sign (spaced or not) or a unit with its exponent after it: by value, not
    # as text (it was matched only where the hint wrote it the same way)
    ("so it is 6.02 \\cdot 10^{23} of them", "6.02x10^{23}", True),
    ("so it is 6.02e23 of them", "6.02x10^{23}", True),
    ("so it is 6.02x10^{23} of them", "6.02 x 10^{23}", True),
    ("so it is 6.02 x10^{23} of them", "6.02x10^{23}", True),
    ("so it is 6.02x10^{23} of them", "6.02e23", True),
    ("so it is 6.02 \\cdot 10^{23} per mole", "6.02\\times10^{23}\\text{ mol}^{-1}", True),
    ("so it is 6.02e23 per mole", "6.02\\times10^{23}\\text{ mol}^{-1}", True),
    ("so it is 6.02\\times10^{23}\\text{ mol}^{-1}", "6.02\\times10^{23}\\text{ mol}^{-1}", True),
    ("it falls at 9.8 m/s^2", "9.8\\text{ m}\\cdot\\text{s}^{-2}", True),
    ("so it is 6.02e22 of them", "6.02x10^{23}", False),
    ("so it is 6.02 of them", "6.02\\times10^{23}\\text{ mol}^{-1}", False),
    ("so it is 23 of them", "6.02x10^{23}", False),
    # ... a capital X for the times sign too, and a unit's exponent inside its braces (\mathrm{mol^{-1}}, also after
    # \operatorname): by value (they were matched only as text)
    ("so it is 6.02X10^{23} of them", "6.02\\times10^{23}", True),
    ("so it is 6.02 X 10^23 of them", "6.02e23", True),
    ("so it is 6.02 \\cdot 10^{23} of them", "6.02X10^{23}", True),
    ("so it is 6.02X10^{22} of them", "6.02e23", False),
    ("so it is 6.02e23 per mole", "6.02\\times10^{23}\\mathrm{mol^{-1}}", True),
    ("so it is 6.02e23 per mole", "6.02\\times10^{23}\\text{ mol^{-1}}", True),
    ("so it is 6.02e23 per mole", "6.02\\times10^{23}\\operatorname{mol}^{-1}", True),
    ("it falls at 9.8 m/s^2", "9.8\\,\\mathrm{m\\,s^{-2}}", True),
    ("so it is 6.02 of them", "6.02\\times10^{23}\\mathrm{mol^{-1}}", False),
    ("so it is 6.02\\times10^{23}\\mathrm{mol^{-1}}", "6.02e23", True),
    ("a rate of 5\\mathrm{s^{-1}}", "-1", False),
    # any other answer as a substring, in the same typesetting: \dfrac is \frac, \left( is (, thin spaces go
    ("the angle is \\frac{\\pi}{4} here", "\\dfrac{\\pi}{4}", True),
    ("the point \\left(1, 2\\right)", "(1,2)", True),
    ("use 2 \\, \\sqrt{3}", "2\\sqrt{3}", True),
    ("the angle \\tfrac{\\pi}{2}", "\\frac{\\pi}{3}", False),
    # a root of one digit or letter without braces, the root sign and \u03c0 as models write them
    ("it is \\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("so 2\\sqrt 3 in all", "2\\sqrt{3}", True),
    ("so 2\u221a3 in all", "2\\sqrt{3}", True),
    ("a turn of 2\u03c0", "2\\pi", True),
    ("a turn of \u03c0/2 first", "\\frac{\\pi}{3}", False),
    ("the root \u221a35 here", "\\sqrt{3}", False),
    ("the root \\sqrt{35} here", "\\sqrt3", False),
    ("then \\sqrt x grows", "\\sqrt{x}", True),
    # a fraction answer written inline (x+1 in parentheses), \u221e, an exponent of one character without braces
    ("a turn of \u03c0/2 first", "\\frac{\\pi}{2}", True),
    ("so the angle is \\pi/4 here", "\\dfrac{\\pi}{4}", True),
    ("it equals \u221a3/2 then", "\\frac{\\sqrt{3}}{2}", True),
    ("so it is (x+1)/2", "\\frac{x+1}{2}", True),
    ("so it is 3\u03c0/4 here", "\\frac{\\pi}{4}", False),
    ("so it is x+1/2", "\\frac{x+1}{2}", False),
    ("the angle \\pi/40 here", "\\frac{\\pi}{4}", False),
    ("so x is in (-\u221e, 3]", "(-\\infty,3]", True),
    ("it is x^{2} + 1 here", "x^2+1", True),
    ("it is x^2 + 10 here", "x^{2}+1", False),
    # numeric answers with a unit, in \text{}, after a variable, or with the sign in the numerator
    ("The side is 5 cm long.", "5\\text{ cm}", True),
    ("so the answer is 12 inches", "12 \\text{ inches}", True),
    ("an area of 3 square meters", "3\\mathrm{m}^2", True),
    ("x is 5", "\\text{5}", True),
    ("so x is 3", "x=3", True),
    ("then -3/4 of it", "\\frac{-3}{4}", True),
    ("The side is 15 cm long.", "5\\text{ cm}", False),
    # other answers as a token of their own: a letter answer is not in every word that holds the letter
    ("Case 2 needs care", "C", False),
    ("so option C is right", "\\text{(C)}", True),
    ("so it is (C)", "\\textbf{(C)}", True),
    ("it grows as x^2 + 10", "x^2+1", False),
    ("it is x^2 + 1 here", "x^2+1", True),
    ("head east ward", "east", True),
    ("the eastern side", "east", False),
    # LaTeX digit grouping as MATH's solutions write it
    ("So the answer is $10,\\!000$", "10000", True),
    ("it is $10{,}000$", "10000", True),
    ("it is $10\\,000$ in all", "10000", True),
    ("$1{,}000{,}000$ ways", "1000000", True),
    ("there are 10000 ways", "10{,}000", True),
    ("about 1,234 coins", "1{,}234", True),
    ("about 234 coins", "1{,}234", False),
    # ... and with a space (also no-break, thin or narrow no-break), in groups of exactly three digits
    ("there are 10 000 ways", "10000", True),
    ("there are 10\u00a0000 ways", "10000", True),
    ("there are 10\u2009000 ways", "10000", True),
    ("there are 10\u202f000 ways", "10000", True),
    ("so 1 000 000 in all", "1000000", True),
    ("it is $10\\ 000$", "10000", True),
    ("there are 10 000 ways", "10", True),
    ("so 10 0000 here", "100000", False),
    ("from 1234 567 on", "1234567", False),
    ("add 10 and then 000", "10000", False),
    # ... in every reading: "12 100" is 12100, 12 and 100; "12 100 200" also 12100 and 100200, where the groups beside
    # leave a number (no number starts 000: 10,000,000 holds no 10000)
    ("rows 12 100 in all", "12", True),
    ("rows 12 100 in all", "100", True),
    ("rows 12 100 in all", "12100", True),
    ("rows 12 100 200 in all", "12100", True),
    ("rows 12 100 200 in all", "100200", True),
    ("rows 12,100,200 in all", "12100", True),
    ("so 1 100 100 here", "1100", True),
    # a sign before the run is its first group's, and so of each run that starts there (as "-12100" is -12100, not
    # 12100): "-12 100 200" is -12, -12100 and -12100200, and also 100, 200 and 100200
    ("so x = -12 100 200 here", "-12100", True),
    ("so x = -12,100,200 here", "-12100", True),
    ("so x = -12 100 200 here", "-12", True),
    ("so x = -12 100 200 here", "-12100200", True),
    ("so x = -12 100 200 here", "100200", True),
    ("so x = -12 100 200 here", "-100200", False),
    ("so x = -12 100 200 here", "-100", False),
    ("so x = -12 100 200 here", "12100", False),
    ("so x = -12100 here", "12100", False),
    ("divide 10,000,000 by 1,000", "10000", False),
    ("divide 10 000 000 by 1 000", "10000", False),
    # numbers that name no quantity: exponents, subscripts, step numbers; a quantity beside them still counts
    ("Factor x^2-4 first.", "2", False),
    ("Use \\sin^2 x + \\cos^2 x = 1.", "2", False),
    ("Compute $3^{4}$ mod 5.", "4", False),
    ("a_1 is the first term", "1", False),
    ("Step 1: add. Step 2: divide.", "2", False),
    ("Factor x^2-4 first.", "-4", False),
    ("x^2 = 4 here", "4", True),
    ("2^{10} = 1024", "1024", True),
    ("after step 3 the total is 2", "2", True),
    # a choice letter is a leak only where it is named as a choice, not as the article "A"
    ("A good first step is to factor.", "A", False),
    ("A first step: factor.", "(A)", False),
    ("A is the right choice.", "A", True),
    ("The answer is (A).", "A", True),
    ("Therefore B is correct.", "B", True),
    ("Pick D, since the others fail.", "D", True),
    ("He walks 5 steps 20 times in all.", "20", True),
    # step labels as models write them (Markdown, capitals), and the level the hint request names echoed as a title
    ("**Step 1**: factor the quadratic.", "1", False),
    ("STEP 2: factor the quadratic.", "2", False),
    ("In step 2, factor the quadratic.", "2", False),
    ("**Step 2**: the total is 2.", "2", True),
    ("### Step 1\nStart from 4.\n### Step 2\nApply the changes.", "2", False),
    ("Step 1 - start from 4. Step 2 - apply the changes.", "1", False),
    ("After step 3 you have 7.", "3", False),
    ("After step 3 you have 7.", "7", True),
    ("Case 1: n is even. Case 2: n is odd.", "2", False),
    ("**Part 2.** Use the sum.", "2", False),
    ("Level 2 hint: factor the quadratic first.", "2", False),
    ("**Hint (Level 3):** write an equation.", "3", False),
    ("Level 1 hint: the answer is 1.", "1", True),
    ("Level 2 (medium): start from 4.", "2", False),
    ("**Level 3 (detailed):** 7 + 5 = 12.", "3", False),
    ("Hint (level 2, medium): start from 4.", "2", False),
    ("Level 2 - medium: show the first step.", "2", False),
    ("Level 2 (medium): the answer is 2.", "2", True),
    ("so option B is right", "B", True),
    # a word answer in another case is the answer; a single letter is not (x is not X, a is the article)
    ("so the answer is yes", "Yes", True),
    ("It falls on MONDAY.", "\\text{Monday}", True),
    ("Try small values of x first.", "X", False),
    ("Let a and b be the sides; find ab first.", "AB", False),  # capitals: a segment, not the word "ab"
    ("so the answer is C", "\\text{(C)}", True),
    # a fraction at a sentence's end or before a comma is still a fraction; 1/2.5 is still 1 over 2.5
    ("Halve it: 1/2.", "0.5", True),
    ("The answer is 1/2.", "\\frac{1}{2}", True),
    ("The answer is 3/4, so check it.", "0.75", True),
    ("The answer is -1/2.", "-\\frac{1}{2}", True),
    ("it is 1/2.5 of it", "0.4", True),
    ("it is 1/2.5 of it", "0.5", False),
    # a numbered list's labels are no quantities (also joined into one line), a number before a period still is
    ("1. Let n be the number.\n2. Write an equation.\n3. Solve it.", "2", False),
    ("1. Let n be the number. 2. Write an equation. 3. Solve it.", "2", False),
    ("1) Let n be it.\n2) Write it", "2", False),
    ("1. Let n be the number\n2. Write an equation\n3. Solve it", "2", False),
    ("The total is 2. Check it.", "2", True),
    ("Add: 2. Then double", "2", True),
    ("Add 7 and 5. 12. Then halve it.", "12", True),
    ("1. The total is 2. Then double it.", "2", True),
    # only a run of labels (1, then 2) is a list: a lone "1." at a line's start is a quantity
    ("The probability equals\n1. So it is certain.", "1", True),
    ("The minimum value is\n1. Achieved when x = 0.", "1", True),
    ("1. Set up the equation.\n2. Solve it.", "1", False),
    ("1. Add 1 and 1. 2. Done here.", "2", False),
    # Markdown lists: an item's title in bold or italics, a bold label
    ("1. **Set up** an equation.\n2. **Solve** it for n.\n3. **Check** it.", "2", False),
    ("1. *Start* from 4.\n2. *Apply* each change.", "1", False),
    ("**1.** Start from 4.\n**2.** Apply the changes.", "2", False),
    ("1. **Total:** 2.\n2. **Double** it.", "2", True),
    # the Unicode minus sign
    ("The result is \u22123.", "-3", True),
    ("x = -3", "\u22123", True),
    ("12\u22123 first", "-3", False),
    ("The result is 3.", "\u22123", False),
    # the en dash, figure dash and small hyphen-minus as a minus, the hyphens U+2010 and U+2011 as a hyphen
    ("The result is \u20137.", "-7", True),
    ("so x = \u2013 7 here", "-7", True),
    ("x = \u20127", "-7", True),
    ("it is \ufe637", "-7", True),
    ("The answer is forty\u2011two.", "42", True),
    ("so x is in (\u2013\u221e, 3]", "(-\\infty,3]", True),
    ("read pages 3\u20137 first", "-7", False),
    ("Level 2 \u2013 medium: start from 4.", "2", False),
    # the em dash is a minus only directly before a number after a space, "(" or the start, or after "=" (and it is
    # read both ways there); elsewhere it is punctuation
    ("The result is \u20147.", "-7", True),
    ("The result is \u20147.", "7", True),
    ("\u20147 is the result", "-7", True),
    ("so x = \u2014 7 here", "-7", True),
    ("the point (\u20143, 5)", "-3", True),
    ("so x = \u2014\\frac{3}{4}", "-0.75", True),
    ("the sum\u20147 apples\u2014is next", "-7", False),
    ("the sum\u20147 apples\u2014is next", "7", True),
    ("add 7 \u2014 5 is left", "-5", False),
    ("read pages 3\u20147 first", "-7", False),
    # ... and so before \u221e (or \infty), as a minus before a number is: there an answer that is no number is read in
    # both readings too
    ("so the limit is \u2014\u221e", "-\\infty", True),
    ("so the limit is \u2014\u221e", "-\u221e", True),
    ("so the limit is \u2014\\infty here", "-\\infty", True),
    ("so x = \u2014 \u221e here", "-\\infty", True),
    ("so x is in (\u2014\u221e, 3]", "(-\\infty,3]", True),
    ("the point (\u20143, 5)", "(-3,5)", True),
    ("it tends to minus \u221e", "-\\infty", True),
    ("so the limit is \u2014\u221e", "\\infty", True),
    ("it grows without bound\u2014\u221e is the limit", "-\\infty", False),
    ("it tends to \u221e", "-\\infty", False),
    # ... and after an opening bracket, a comma or a comparison sign, where no prose puts a dash
    ("so x is in [\u20143, 5]", "[-3,5]", True),
    ("so x is in [\u20143, 5]", "-3", True),
    ("the point (3,\u20147)", "(3,-7)", True),
    ("so x<\u20147 here", "-7", True),
    ("so x \u2264 \u2014 7 here", "-7", True),
    # a minus glued to a LaTeX relation, arrow or binary operator is a sign (as after "=" or "<"), and so the em dash
    # there; after a symbol that is an operand (\pi, \infty, \alpha) or in a longer command it is a subtraction
    ("so x\\le-7 here", "-7", True),
    ("so x\\leq-7 here", "-7", True),
    ("so x\\geq-7 here", "-7", True),
    ("so x\\ne-7 here", "-7", True),
    ("it is 2\\times-7 first", "-7", True),
    ("so x\\to-3 here", "-3", True),
    ("so y\\approx-2.5 here", "-2.5", True),
    ("so y\\approx-6.02e23 here", "-6.02e23", True),
    ("so x\\le-50\\% here", "-0.5", True),
    ("so x\\le\u20147 here", "-7", True),
    ("so x \\geq \u2014 7 here", "-7", True),
    ("so x\\le\u2014\\infty here", "-\\infty", True),
    ("so x \\le minus 7 here", "-7", True),
    ("so x \\geq minus seven", "-7", True),
    ("so x \\Rightarrow-7 here", "-7", True),
    ("so x\\implies-7 here", "-7", True),
    ("so x\\ll-7 here", "-7", True),
    ("so x \\le - 7 here", "-7", True),
    ("so x < - 7 here", "-7", True),
    ("so x \u2265 - 7 here", "-7", True),
    ("so 2 \\times - 7 first", "-7", True),
    # LaTeX's plain spaces are spaces: a minus after one is a sign as after a space (it was read after the letters)
    ("so x =\\quad-3 here", "-3", True),
    ("so x =\\qquad-3 here", "-3", True),
    ("so x =\\hspace{1em}-3 here", "-3", True),
    ("so x =\\ -3 here", "-3", True),
    ("so x = 3\\quad and y = 4", "3", True),
    ("it is 2\\quad 5 in all", "25", False),
    ("use the \\quadratic formula", "-3", False),
    ("it is \\pi - 3 in all", "-3", False),
    ("so x\\llap-3 here", "-3", False),
    ("it is 2\\pi-3 in all", "-3", False),
    ("it is 2\\pi\u20143 in all", "-3", False),
    ("it is \\alpha-3 in all", "-3", False),
    ("so \\infty-3 is \\infty", "-3", False),
    ("it is \\top-3 here", "-3", False),
    ("so x\\nearrow-3 here", "-3", False),
    ("so \\inf-3 here", "-3", False),
    ("it is \\pi minus 7", "-7", False),
    ("so it is \\infty minus 7", "-7", False),
    # infinity in words is \infty, "minus infinity" and "negative infinity" -\infty (as "minus 7" is -7)
    ("the limit is minus infinity", "-\\infty", True),
    ("it tends to negative infinity", "-\\infty", True),
    ("so x is in (-infinity, 3]", "(-\\infty,3]", True),
    ("the limit is Infinity", "\\infty", True),
    ("it tends to infinity", "-\\infty", False),
    # full-width forms as ASCII, invisible characters (zero-width, word joiner, BOM, soft hyphen) as none
    ("it is \uff11\uff12 in all", "12", True),
    ("x = \uff0d\uff17", "-7", True),
    ("it is \uff11\uff0f\uff12 of it", "0.5", True),
    ("about \uff15\uff10\uff05 of them", "1/2", True),
    ("it is 1\u200b2 in all", "12", True),
    ("it is 1\u200c2\u200d3 in all", "123", True),
    ("it is 1\u20602 in all", "12", True),
    ("it is \ufeff1\u00ad2 in all", "12", True),
    ("it is 1\u200b2 in all", "2", False),
    ("so option \uff23 is right", "\\text{(C)}", True),
])
def test_leak_guard(hint, answer, leak):
    assert leaks(hint, answer) is leak


def test_leak_guard_reads_a_long_hint_of_many_signs_in_linear_time():
    """Whether "minus" is a sign is read from the words just before it, not from the whole hint before it each time
    (a teacher's hint may be long and repeat itself: 4,000 signs took about 20 s)."""
    started = time.perf_counter()
    assert leaks("minus 1 " * 4000, "-1") and not leaks("minus 1 " * 4000, "-2")
    assert time.perf_counter() - started < 5


def test_leak_guard_reads_a_long_run_of_spaced_numbers_as_numbers_of_at_most_seven_groups():
    """A repeated "100 100 100 ..." is read in numbers of at most seven groups, not as one number of 6,000 digits
    (Python refuses to read an int of more than 4,300: a ValueError, not a verdict)."""
    assert leaks("100 " * 2000, "100100100100100100100") and not leaks("100 " * 2000, "100100100100100100100100")


def test_leak_guard_gives_a_verdict_on_numbers_of_more_digits_than_python_reads():
    """A hint (a teacher's, a degenerate self-hint) with a number of over 4,300 digits, plain, grouped by commas, the
    decimals of a number or before a scale word, made leaks() raise Python's ValueError for an int that long, which
    stopped the run. Such a number is no number now (no answer has 1,000 digits); what else the hint says is still
    read, and an answer that long is matched as text."""
    digits = "7" * 5000
    for hint in (digits, ",".join(["100"] * 2000), "1." + digits, digits + "e1", digits + " thousand",
                 "x = 1{,}" + "{,}".join(["000"] * 2000), "2 " + digits + "/3",
                 "\\,".join(["1"] + ["000"] * 1600) + " \\times 10^3"):  # thin spaces: one number where removed
        assert leaks(hint, "8") is False, hint[:20]
        assert leaks(f"it is 8, then {hint}", "8") is True, hint[:20]
    assert leaks(f"so {digits} it is", digits) and not leaks("so 7 it is", digits)
    assert leaks("1" * 200, "1" * 200) and not leaks("1" * 200, "1" * 199)  # a long answer (100! has 158 digits)
    # an answer in scientific notation of so long a mantissa is text too (its value is not taken)
    assert leaks(f"so {digits}e1 it is", digits + "e1") and not leaks("so 7 it is", digits + "e1")


def test_hinted_prompt_keeps_problem_and_adds_hint():
    p = hinted_problem("What is 2 + 3 ?", "Add .")
    assert p.startswith("What is 2 + 3 ?") and p.endswith("Add .") and "hint" in p
    assert hinted_problem("What is 2 + 3 ?", None) == "What is 2 + 3 ?"
    with pytest.raises(ValueError, match="level"):
        hint_request("q", "s", 4)


class ScriptedModel:
    """A stand-in policy that answers hint requests from a script, recording what it was asked."""

    def __init__(self, outputs):
        self.outputs, self.calls, self.temperatures = list(outputs), [], []

    def __call__(self, prompts, max_new_tokens, temperature):
        self.calls.append((len(prompts), max_new_tokens))
        self.temperatures.append(temperature)
        return [self.outputs.pop(0) for _ in prompts]


def test_online_hints_resample_leaks_and_record_them():
    model = ScriptedModel(["12 - 3 = 9 .", "", "7 + 5 = 12 . Then 12 - 3 ."])
    ctx = HintContext(generate=model, max_new_tokens=16, retries=2)
    [res] = OnlineHints().get([req()], ctx)
    assert res.text == "7 + 5 = 12 . Then 12 - 3 ." and res.leaked and res.attempts == 3
    assert model.temperatures == [0.0, 1.0, 1.0]  # greedy first (the paper's hints), then resampled
    # the same number of generate calls whatever happens (processes stay in step), later ones empty
    ctx2 = HintContext(generate=ScriptedModel(["Use + then - ."]), retries=2)
    sample_hints([req(level=1)], ctx2)
    assert [n for n, _ in ctx2.generate.calls] == [1, 0, 0]


def test_online_hint_that_always_leaks_is_a_failure_not_a_hint():
    ctx = HintContext(generate=ScriptedModel(["= 9"] * 3), retries=2)
    [res] = OnlineHints().get([req()], ctx)
    assert res.failed and res.leaked


def test_request_prompt_without_solution_is_answer_free():
    r = HintRequest("p", "What is 2 + 3 ?", "", "5", 1)
    text = request_prompt(r)[-1]["content"]
    assert "not available" in text and "5" not in text.replace("2 + 3", "")


def test_fixed_hints_written_once_by_initial_policy_and_reused(tmp_path):
    rows = [{"prompt_id": "a", "problem": "q a", "solution": "s", "answer": "9"},
            {"prompt_id": "b", "problem": "q b", "solution": "s", "answer": "9"}]
    model = ScriptedModel([f"hint {i}" for i in range(6)])
    src = FixedHints(tmp_path / "fixed.jsonl")
    src.prepare(rows, HintContext(generate=model, retries=0))
    assert len(src.hints) == 6 and (tmp_path / "fixed.jsonl").exists()
    again = FixedHints(tmp_path / "fixed.jsonl")  # a resumed run reads the file, no generation
    again.prepare(rows, HintContext(generate=ScriptedModel([]), retries=0))
    assert again.hints == src.hints
    [res] = again.get([HintRequest("b", "q b", "s", "9", 2)], HintContext(generate=ScriptedModel([])))
    assert res.text == src.hints[("b", 2)]


def test_fixed_hints_are_written_once_even_when_none_was_usable(tmp_path):
    """The initial policy's hints are its hints even when every sample leaked (an empty file): a resumed run reads
    them, its trained policy writes none."""
    rows = [{"prompt_id": "a", "problem": "q a", "solution": "s", "answer": "9"}]
    src = FixedHints(tmp_path / "fixed.jsonl")
    src.prepare(rows, HintContext(generate=ScriptedModel(["= 9"] * 3), retries=0))
    assert src.hints == {} and src.path.exists() and src.leaked == {("a", 1), ("a", 2), ("a", 3)}
    trained = ScriptedModel(["a hint"] * 3)
    again = FixedHints(tmp_path / "fixed.jsonl")
    again.prepare(rows, HintContext(generate=trained, retries=0))
    assert trained.calls == [] and again.hints == {} and again.leaked == src.leaked


def test_fixed_hints_started_over_are_written_again(tmp_path):
    """A run that starts over (--no-resume) discards the hints its initial policy wrote, files included; the next
    prepare writes them again. A process that does not delete the files still forgets what it read."""
    rows = [{"prompt_id": "a", "problem": "q a", "solution": "s", "answer": "9"}]
    src = FixedHints(tmp_path / "fixed.jsonl")
    src.prepare(rows, HintContext(generate=ScriptedModel(["old 1", "= 9", "old 3", "= 9"]), retries=1))
    assert src.leaked == {("a", 2)} and src.leaks_path.exists()
    other = FixedHints(tmp_path / "fixed.jsonl")
    other.start_over(delete=False)
    assert other.hints == {} and other.leaked == set() and src.path.exists()
    src.start_over()
    assert not src.path.exists() and not src.leaks_path.exists() and src.hints == {}
    src.prepare(rows, HintContext(generate=ScriptedModel(["new 1", "new 2", "new 3"]), retries=1))
    assert FixedHints(tmp_path / "fixed.jsonl").hints == {("a", 1): "new 1", ("a", 2): "new 2", ("a", 3): "new 3"}
    assert src.leaked == set()


def test_fixed_hints_resumed_report_the_same_leaks(tmp_path):
    """A fixed hint whose every sample leaked is no hint, and stays a leak for a resumed run (read from the files),
    as does one written after a leaked sample."""
    rows = [{"prompt_id": "a", "problem": "q a", "solution": "s", "answer": "9"}]
    model = ScriptedModel(["= 9", "hint 2", "= 9", "hint 1", "= 9"])  # levels 1-3, then the resamples of 1 and 3
    src = FixedHints(tmp_path / "fixed.jsonl")
    src.prepare(rows, HintContext(generate=model, retries=1))
    reqs = [HintRequest("a", "q a", "s", "9", lvl) for lvl in (1, 2, 3)]
    first = src.get(reqs, HintContext(generate=ScriptedModel([])))
    assert [(r.text, r.leaked) for r in first] == [("hint 1", True), ("hint 2", False), (None, True)]
    again = FixedHints(tmp_path / "fixed.jsonl")
    again.prepare(rows, HintContext(generate=ScriptedModel([]), retries=1))
    assert again.get(reqs, HintContext(generate=ScriptedModel([]))) == first


def test_teacher_file_hints_and_leak_guard(tmp_path):
    path = tmp_path / "teacher.jsonl"
    write_hints(path, [("p1", 3, "7 + 5 = 12 ."), ("p1", 2, "it is 9")])
    src = TeacherHints(str(path))
    ctx = HintContext(generate=ScriptedModel([]))
    good, leaked, missing = src.get([req(level=3), req(level=2), req(level=1)], ctx)
    assert good.text == "7 + 5 = 12 ." and leaked.failed and leaked.leaked and missing.failed


def test_bad_hints_file_names_the_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt_id": "a", "level": 1, "hint": "x"}) + "\n" + json.dumps({"prompt_id": "b"}))
    with pytest.raises(ValueError, match="row 1 lacks"):
        read_hints(path)
    with pytest.raises(FileNotFoundError, match="teacher hints file not found"):
        TeacherHints(str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("content,needle", [
    ('{"prompt_id": "a", "level": 1, "hint": "x"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"prompt_id": "a", "level": 2.5, "hint": "x"}\n', "row 0 has level 2.5"),
    ('{"prompt_id": "a", "level": "two", "hint": "x"}\n', "row 0 has level 'two'"),
    ('{"prompt_id": "a", "level": 4, "hint": "x"}\n', "row 0 has level 4"),
])
def test_malformed_hints_files_are_data_errors_naming_the_place(tmp_path, content, needle):
    path = tmp_path / "hints.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=needle):
        read_hints(path)


def test_null_or_blank_hints_are_missing_and_a_second_different_hint_is_refused(tmp_path, caplog):
    """A null or blank hint is no hint (the level fails, it is not rolled as an empty hint), counted in a warning;
    one prompt and level given two different hints is an error naming both, the same hint twice is not."""
    path = tmp_path / "hints.jsonl"
    rows = [{"prompt_id": "p1", "level": 1, "hint": None}, {"prompt_id": "p1", "level": 2, "hint": " "},
            {"prompt_id": "p1", "level": 3, "hint": "7 + 5 = 12 ."},
            {"prompt_id": "p1", "level": 3, "hint": "7 + 5 = 12 ."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="sage_core.hints"):
        assert read_hints(path) == {("p1", 3): "7 + 5 = 12 ."}
    assert "2 of 4 rows have a null or blank hint" in caplog.text
    none, blank, good = TeacherHints(str(path)).get([req(level=1), req(level=2), req(level=3)],
                                                    HintContext(generate=ScriptedModel([])))
    assert none.failed and blank.failed and good.text == "7 + 5 = 12 ."
    path.write_text(path.read_text() + json.dumps({"prompt_id": "p1", "level": 3, "hint": "Use + then - ."}) + "\n")
    with pytest.raises(DataError, match=r"hints.jsonl: row 4 gives prompt 'p1' level 3 a second hint"):
        TeacherHints(str(path))


def test_a_hints_file_that_covers_none_of_the_training_prompts_is_refused(tmp_path, caplog):
    """A teacher hints file is matched to the training rows by prompt id: one that covers none of them would turn
    a SAGE run into GRPO (every hint failed), one that covers less than half is worth a warning."""
    from sage_core.data import synthetic_rows

    rows = synthetic_rows(4, seed=0)
    path = tmp_path / "teacher.jsonl"
    ctx = HintContext(generate=ScriptedModel([]))
    write_hints(path, [(f"other-{i}", 1, "add first .") for i in range(4)])
    with pytest.raises(DataError, match=r"teacher.jsonl: its hints cover none of the 4 training prompts \(it has "
                                        r"hints for 4 prompt ids"):
        TeacherHints(str(path)).prepare(rows, ctx)
    write_hints(path, [("syn-0-0", 1, "add first .")])
    with caplog.at_level("WARNING", logger="sage_core.hints"):
        TeacherHints(str(path)).prepare(rows, ctx)
    assert "its hints cover 1 of the 4 training prompts" in caplog.text
    caplog.clear()
    write_hints(path, [(r["prompt_id"], 1, "add first .") for r in rows[:2]])
    with caplog.at_level("WARNING", logger="sage_core.hints"):
        TeacherHints(str(path)).prepare(rows, ctx)
    assert caplog.text == ""


def test_hints_written_for_another_problem_under_the_same_id_are_ignored(tmp_path, caplog):
    """Synthetic prompt ids do not name the difficulty: hints written for the easy problems of a seed, with their
    problem_sha, are not used for its hard problems (a warning counts them); rows without problem_sha are matched by
    prompt id alone, as before."""
    from sage_core.data import synthetic_rows

    easy, hard = synthetic_rows(4, seed=0, difficulty="easy"), synthetic_rows(4, seed=0, difficulty="hard")
    assert [r["prompt_id"] for r in easy] == [r["prompt_id"] for r in hard]
    path = tmp_path / "teacher.jsonl"
    ctx = HintContext(generate=ScriptedModel([]))
    hints = [(r["prompt_id"], 1, "add first .") for r in easy]
    write_hints(path, hints, {r["prompt_id"]: problem_sha(r["problem"]) for r in easy})
    src = TeacherHints(str(path))
    src.prepare(easy, ctx)
    assert src.get([req("syn-0-0", 1)], ctx)[0].text == "add first ."
    with pytest.raises(DataError, match=r"cover none of the 4 training prompts.*; 4 hints were written for other "
                                        r"problems under the same ids"):
        TeacherHints(str(path)).prepare(hard, ctx)
    write_hints(path, [*hints, ("syn-0-0", 2, "a step .")], {r["prompt_id"]: problem_sha(r["problem"])
                                                             for r in easy[1:]})
    src = TeacherHints(str(path))
    with caplog.at_level("WARNING", logger="sage_core.hints"):
        src.prepare(hard, ctx)
    assert "3 hints were written for another problem under the same prompt id" in caplog.text
    assert [r.text for r in src.get([req(r["prompt_id"], 1) for r in hard], ctx)] == ["add first .", *[None] * 3]
    assert src.get([req("syn-0-0", 2)], ctx)[0].text == "a step ."


def test_one_hints_file_holds_hints_for_several_problems_under_one_id(tmp_path):
    """`sage hints` outputs for the easy and the hard problems of one seed joined into one file: the same prompt ids
    and levels, each hint with its problem's problem_sha. Training on either picks its own problems' hints; two
    different hints for one id, level and problem are still refused, naming the problem_sha."""
    from sage_core.data import synthetic_rows

    easy, hard = synthetic_rows(3, seed=0, difficulty="easy"), synthetic_rows(3, seed=0, difficulty="hard")
    path, ctx = tmp_path / "both.jsonl", HintContext(generate=ScriptedModel([]))
    write_hints(tmp_path / "easy.jsonl", [(r["prompt_id"], 1, f"easy {i} .") for i, r in enumerate(easy)],
                {r["prompt_id"]: problem_sha(r["problem"]) for r in easy})
    write_hints(tmp_path / "hard.jsonl", [(r["prompt_id"], 1, f"hard {i} .") for i, r in enumerate(hard)],
                {r["prompt_id"]: problem_sha(r["problem"]) for r in hard})
    path.write_text((tmp_path / "easy.jsonl").read_text() + (tmp_path / "hard.jsonl").read_text())
    for rows, kind in ((easy, "easy"), (hard, "hard")):
        src = TeacherHints(str(path))
        src.prepare(rows, ctx)
        got = [r.text for r in src.get([req(r["prompt_id"], 1) for r in rows], ctx)]
        assert got == [f"{kind} {i} ." for i in range(3)]
    assert read_hints(path) == {}  # with no training problems to match, an id with hints for two problems has none
    clash = {"prompt_id": "syn-0-0", "level": 1, "hint": "other .", "problem_sha": problem_sha(hard[0]["problem"])}
    path.write_text(path.read_text() + json.dumps(clash) + "\n")
    with pytest.raises(DataError, match=rf"row 6 gives prompt 'syn-0-0' level 1 \(problem_sha "
                                        rf"{clash['problem_sha']}\) a second hint"):
        TeacherHints(str(path))


def test_hint_levels_as_numeric_strings_or_whole_floats_read_back_as_ints(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"prompt_id": "a", "level": "2", "hint": "x"}\n{"prompt_id": 7, "level": 3.0, "hint": "y"}\n')
    assert read_hints(path) == {("a", 2): "x", ("7", 3): "y"}


def test_local_model_teacher_writes_greedy_guarded_cached_hints(tiny_model_dir):
    """A teacher given as a local model path: the tiny model writes the hints (greedy first, so two teachers agree),
    the leak guard applies, and a hint once written is not asked for again."""
    from sage_core.data import synthetic_rows

    rows = synthetic_rows(6, seed=3, difficulty="hard")
    reqs = [HintRequest(r["prompt_id"], r["problem"], r["solution"], r["answer"], lvl) for r in rows for lvl in (1, 3)]
    ctx = HintContext(generate=ScriptedModel([]), retries=1)  # the policy is never asked: the teacher writes
    teacher = TeacherHints(str(tiny_model_dir), max_new_tokens=48)
    calls = []
    gen = teacher._generate
    teacher._generate = lambda prompts, n, t: calls.append((len(prompts), t)) or gen(prompts, n, t)
    first = teacher.get(reqs, ctx)
    assert calls[0] == (len(reqs), 0.0) and all(t == 1.0 for _, t in calls[1:])
    written = [(q, r) for q, r in zip(reqs, first, strict=True) if r.text]
    assert len(written) >= len(reqs) // 2  # the warm-started model writes most hints
    assert all(not leaks(r.text, q.answer) for q, r in written)
    assert any(r.text != q.solution for q, r in written)  # hints, not the solution copied back
    n_calls = len(calls)
    assert [r.text for r in teacher.get(reqs, ctx)] == [r.text for r in first] and len(calls) == n_calls
    other = TeacherHints(str(tiny_model_dir), max_new_tokens=48)  # greedy: a second teacher writes the same hints
    again = other.get([q for q, _ in written], ctx)
    assert sum(a.text == r.text for a, (_, r) in zip(again, written, strict=True)) >= len(written) - 1


def test_local_model_teacher_resamples_are_new_samples(tiny_model_dir):
    """Each call of a local teacher samples with a seed of its own: the resamples after a leak (temperature 1) are
    not the first sample again."""
    from sage_core.data import synthetic_rows

    teacher = TeacherHints(str(tiny_model_dir), max_new_tokens=48)
    prompts = [request_prompt(HintRequest(r["prompt_id"], r["problem"], r["solution"], r["answer"], 3))
               for r in synthetic_rows(8, seed=3, difficulty="hard")]
    first, second = (teacher._generate(prompts, 48, 1.0) for _ in range(2))
    assert first != second


def test_hints_parquet_reads_back_and_a_corrupt_one_is_a_data_error(tmp_path):
    import pandas as pd

    good = tmp_path / "hints.parquet"
    pd.DataFrame([{"prompt_id": "a", "level": 1, "hint": "x"}]).to_parquet(good)
    assert read_hints(good) == {("a", 1): "x"}
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_hints(bad)


class _ChatEndpoint:
    """A real loopback HTTP server speaking the chat-completions protocol of an OpenAI-compatible teacher (vllm
    serve): `answer(body) -> (status, reply text)` decides each reply (a text given as bytes is sent as the whole
    body, as a proxy's HTML page; a callable answer writes the reply itself); GET /v1/models lists `models` (None:
    404, a server without that path). Every chat request body, every request's Authorization header and the most
    requests in flight at once are recorded."""

    def __init__(self, answer, models=("default",), port=None):
        import http.server
        import threading
        import time

        self.bodies, self.auth, self.in_flight, self.most = [], [], 0, 0
        lock, outer = threading.Lock(), self

        class Handler(http.server.BaseHTTPRequestHandler):
            def send(self, status, reply):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self):
                with lock:
                    outer.auth.append((self.path, self.headers.get("Authorization")))
                if self.path == "/v1/models" and models is not None:
                    return self.send(200, json.dumps({"object": "list", "data": [{"id": m, "object": "model"}
                                                                                 for m in models]}).encode())
                self.send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.bodies.append(body)
                    outer.auth.append((self.path, self.headers.get("Authorization")))
                    outer.in_flight += 1
                    outer.most = max(outer.most, outer.in_flight)
                time.sleep(0.05)
                reply = answer(body) if self.path == "/v1/chat/completions" else (404, "no such path")
                with lock:
                    outer.in_flight -= 1
                if callable(reply):
                    return reply(self)
                status, text = reply
                self.send(status, text if isinstance(text, bytes) else json.dumps(
                    {"choices": [{"message": {"role": "assistant", "content": text}}]} if status == 200
                    else {"error": text}).encode())

            def log_message(self, *a):
                pass

        for candidate in [port] if port else _loopback_ports():
            try:
                self.server = http.server.ThreadingHTTPServer(("127.0.0.1", candidate), Handler)
                break
            except OSError:
                if port:
                    raise
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _loopback_ports():
    """The loopback ports tests may listen on (18000-18999), from a random one on."""
    import random

    start = random.randrange(1000)
    return [18000 + (start + i) % 1000 for i in range(1000)]


@pytest.fixture(autouse=True)
def _no_startup_wait(monkeypatch):
    """An endpoint that is not there fails its check at once (the tests of a server still starting set the wait)."""
    monkeypatch.setenv("SAGE_TEACHER_STARTUP_WAIT", "0")


def _fast_retries(monkeypatch):
    from functools import partial

    from sage_core import hints

    monkeypatch.setattr(hints, "_openai_generate", partial(hints._openai_generate, backoff=0.01))


def test_endpoint_teacher_asks_concurrently_and_retries_transient_failures(monkeypatch):
    """Hints from an OpenAI-compatible endpoint: requests go out several at a time, a 503 or 429 is tried again,
    the served model's name and the hint settings are sent, a leaking reply is rejected, and a hint once written is
    not asked for again."""
    _fast_retries(monkeypatch)
    failures = iter([503, 429, 503])

    def answer(body):
        status = next(failures, 200)
        problem = body["messages"][-1]["content"]
        return status, ("the answer is 9" if "She gives away 3" in problem and "level 1 hint" in problem
                        else "Add first , then take away .")

    reqs = [HintRequest(f"p{i}", f"Ann has {i} coins . She gets 5 more . She gives away {i % 4} .", "", "9", lvl)
            for i in range(8) for lvl in (1, 2)]
    with _ChatEndpoint(answer, models=["qwen-teacher"]) as teacher:
        src = TeacherHints(teacher.url, model="qwen-teacher", max_new_tokens=32)
        got = src.get(reqs, HintContext(generate=ScriptedModel([]), retries=1))
        asked = len(teacher.bodies)
        again = src.get(reqs, HintContext(generate=ScriptedModel([]), retries=1))
    # written hints come from the cache; only the two failed ones are asked again (a sample and a resample each)
    assert [r.text for r in again] == [r.text for r in got] and len(teacher.bodies) - asked == 2 * 2
    assert teacher.most > 1  # concurrent requests
    first = teacher.bodies[0]
    assert (first["model"], first["max_tokens"], first["temperature"]) == ("qwen-teacher", 32, 0.0)
    assert asked >= len(reqs) + 3  # the three transient failures were tried again
    leaked = [(q.prompt_id, q.level) for q, r in zip(reqs, got, strict=True) if r.leaked]
    assert leaked == [("p3", 1), ("p7", 1)] and all(got[i].failed for i in (6, 14))  # rejected, resampled, failed
    assert [r.text for r in got].count("Add first , then take away .") == len(reqs) - 2


def test_endpoint_teacher_that_stays_down_fails_the_hints_and_one_that_refuses_says_why(monkeypatch, caplog):
    _fast_retries(monkeypatch)
    reqs = [HintRequest("p1", "Ann has 7 coins .", "", "9", 1), HintRequest("p2", "Bob has 2 coins .", "", "4", 2)]
    with _ChatEndpoint(lambda body: (503, "overloaded")) as down:
        got = TeacherHints(down.url).get(reqs, HintContext(generate=ScriptedModel([]), retries=1))
    assert [r.failed for r in got] == [True, True] and not any(r.leaked for r in got)
    assert len(down.bodies) == 2 * 3  # 2 hints x 3 tries each; a hint the endpoint never answered is not resampled
    assert ("2 of 2 hint requests got no answer (each tried up to 3 times within 120s; the last failure: HTTP 503)"
            in caplog.text)
    with _ChatEndpoint(lambda body: (400, "model 'default' does not exist")) as wrong, pytest.raises(
            TeacherError, match=r"HTTP 400: .*model 'default' does not exist.*set teacher_model"):
        TeacherHints(wrong.url).get(reqs, HintContext(generate=ScriptedModel([])))
    assert len(wrong.bodies) <= len(reqs)  # not retried
    # a request over the served model's context (vLLM's 400): that hint fails, the run goes on, warned about once
    caplog.clear()
    too_long = ("This model's maximum context length is 64 tokens. However, you requested 96 tokens (32 in the "
                "messages, 64 in the completion). Please reduce the length of the messages or completion.")
    with _ChatEndpoint(lambda body: (400, json.dumps({"object": "error", "message": too_long}))) as small:
        got = TeacherHints(small.url).get(reqs, HintContext(generate=ScriptedModel([]), retries=1))
    assert [r.failed for r in got] == [True, True] and len(small.bodies) == 2  # neither retried nor resampled
    assert caplog.text.count("does not fit the served model's context") == 1
    # llama.cpp's and SGLang's words for it: the same (they stopped the run with a TeacherError)
    for words in ("the request exceeds the available context size, try increasing it",
                  "The input (96 tokens) is longer than the model's context length (64 tokens)."):
        with _ChatEndpoint(lambda body, w=words: (400, json.dumps({"error": {"code": 400, "message": w}}))) as other:
            got = TeacherHints(other.url).get(reqs, HintContext(generate=ScriptedModel([]), retries=1))
        assert [r.failed for r in got] == [True, True] and len(other.bodies) == 2, words


def test_sage_hints_writes_a_teachers_hints_file_that_a_stopped_run_resumes(monkeypatch, tmp_path, capsys):
    """`sage hints` asks the teacher for every training prompt of the spec at each level, saves
    FILE.partial.jsonl chunk by chunk (a run stopped by an error keeps what it wrote, and the next run asks only for
    the rest), and leaves a hints file keyed by the prompt ids training uses; leaking replies are not written."""
    from sage_core import cli
    from sage_core.data import build_dataset
    from sage_core.presets import preset

    _fast_retries(monkeypatch)
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    refuse_after = [6]

    def answer(body):
        if len(teacher.bodies) > refuse_after[0]:
            return 400, "quota exhausted"
        problem = body["messages"][-1]["content"]
        return 200, "the answer is " + problem.split("Solution: ")[1].split("\\boxed{")[-1].split("}")[0] \
            if "level 3 hint" in problem else "Work from left to right ."

    out = tmp_path / "teacher.jsonl"
    args = ["hints", "--set", "num_prompts=4", "--set", "prompts_per_step=4", "--out", str(out), "--chunk", "4"]
    with _ChatEndpoint(answer) as teacher:
        assert cli.main([*args, "--teacher", teacher.url]) == 2  # the teacher refuses after 6 requests
        err = capsys.readouterr().err
        assert "sage hints: teacher endpoint" in err and "quota exhausted" in err
        partial = read_hints(tmp_path / "teacher.partial.jsonl")
        # the first chunk (syn-0-0 at levels 1-3, syn-0-1 at 1) was saved, less its leaked level-3 hint
        assert len(partial) == 3 and ("syn-0-0", 3) not in partial and not out.exists()
        refuse_after[0] = 10**6
        asked = len(teacher.bodies)
        from sage_core import data as data_mod
        from sage_core import hints as hints_mod

        reads, read_records = [], data_mod.read_records

        def counted(path, *a, **k):
            reads.append(str(path))
            return read_records(path, *a, **k)

        monkeypatch.setattr(data_mod, "read_records", counted)
        monkeypatch.setattr(hints_mod, "read_records", counted)
        assert cli.main([*args, "--teacher", teacher.url]) == 0
        assert reads.count(str(tmp_path / "teacher.partial.jsonl")) == 1  # read once (it was read twice)
        shown = capsys.readouterr().out
        assert "resuming: 3 hints already" in shown
        assert len(teacher.bodies) - asked == 12 - 3 + 4 * 2  # the rest; each leaked level-3 hint resampled twice
    hints = read_hints(out)
    ids = [r["prompt_id"] for r in build_dataset(preset("tiny-cpu", num_prompts=4, prompts_per_step=4))]
    assert set(hints) == {(pid, lvl) for pid in ids for lvl in (1, 2)}  # level 3 leaked every time: not written
    assert set(hints.values()) == {"Work from left to right ."}
    assert not (tmp_path / "teacher.partial.jsonl").exists()
    assert "    3        0       4       0" in shown
    assert cli.main([*args, "--teacher", "http://127.0.0.1:9/v1"]) == 2  # the file is there: not written over
    assert "exists; give another path, or --force" in capsys.readouterr().err



def test_sage_hints_keeps_a_file_made_at_out_while_the_teacher_is_asked(monkeypatch, tmp_path, capsys):
    """A file made at --out by someone else while the teacher was asked was replaced by the hints at the end, lost.
    Without --force it stays as it was, the hints stay in FILE.partial.jsonl, one line on stderr says so and the
    command exits 1; the same command with --force then writes them to --out without asking the teacher again."""
    from sage_core import cli

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    out, partial = tmp_path / "teacher.jsonl", tmp_path / "teacher.partial.jsonl"

    def answer(body):
        out.write_text("another process's hints\n")  # made while this one asks
        return 200, "Work from left to right ."

    args = ["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1", "--out", str(out)]
    with _ChatEndpoint(answer) as teacher:
        assert cli.main([*args, "--teacher", teacher.url]) == 1
        assert capsys.readouterr().err == (f"sage hints: --out {out}: a file was made there while the hints were "
                                           f"asked, not written over; the 2 hints are in {partial} (the same command "
                                           f"with --force writes them to {out})\n")
        assert out.read_text() == "another process's hints\n"
        assert set(read_hints(partial)) == {("syn-0-0", 1), ("syn-0-1", 1)}
        asked = len(teacher.bodies)
        assert cli.main([*args, "--teacher", teacher.url, "--force"]) == 0
        assert len(teacher.bodies) == asked  # nothing asked again
    assert set(read_hints(out).values()) == {"Work from left to right ."} and not partial.exists()

def test_sage_hints_never_writes_over_the_data_files_of_its_spec(monkeypatch, tmp_path, capsys):
    """`--out` naming the training data file (or the eval data file, or one whose partial file is one of them)
    with --force replaced the data rows by hint rows; it is refused before the teacher is asked, files unchanged."""
    from sage_core import cli
    from sage_core.data import synthetic_rows

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    data, evald = tmp_path / "train.jsonl", tmp_path / "ev.partial.jsonl"
    for f in (data, evald):
        f.write_text("".join(json.dumps({k: r[k] for k in ("problem", "solution", "answer")}) + "\n"
                             for r in synthetic_rows(4, seed=1)))
    before = {f: f.read_bytes() for f in (data, evald)}
    sets = ["--set", f"data={data}", "--set", "num_prompts=4", "--set", "prompts_per_step=4",
            "--set", f"eval_data={evald}"]
    for out, what in ((data, f"{data} is the training data (data=)"), (tmp_path / "ev.jsonl",
                                                                       f"{evald} is the eval data (eval_data=)")):
        assert cli.main(["hints", *sets, "--teacher", "http://127.0.0.1:9/v1", "--out", str(out), "--force"]) == 2
        assert what in capsys.readouterr().err
    assert {f: f.read_bytes() for f in before} == before


def test_sage_hints_resumes_only_the_hints_written_for_the_same_problems(monkeypatch, tmp_path, capsys):
    """A FILE.partial.jsonl left by a run on easy problems has the same prompt ids as the hard problems of that seed:
    `sage hints` for the hard ones keeps only the hints whose problem_sha is a hard problem's, asks again for the
    others (saying how many), and writes each hint with its problem's problem_sha."""
    from sage_core import cli
    from sage_core.data import synthetic_rows

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    easy, hard = synthetic_rows(3, seed=0, difficulty="easy"), synthetic_rows(3, seed=0, difficulty="hard")
    shas = {r["prompt_id"]: problem_sha(r["problem"]) for r in hard}
    out = tmp_path / "teacher.jsonl"
    write_hints(tmp_path / "teacher.partial.jsonl", [("syn-0-0", 1, "hard hint ."), ("syn-0-1", 1, "easy hint ."),
                                                     ("syn-0-2", 1, "old hint .")],
                {"syn-0-0": shas["syn-0-0"], "syn-0-1": problem_sha(easy[1]["problem"])})
    with _ChatEndpoint(lambda body: (200, "Work from left to right .")) as teacher:
        assert cli.main(["hints", "--set", "num_prompts=3", "--set", "prompts_per_step=3", "--set", "difficulty=hard",
                         "--levels", "1", "--out", str(out), "--teacher", teacher.url]) == 0
    assert len(teacher.bodies) == 2  # syn-0-1 (another problem's hint) and syn-0-2 (no problem_sha)
    shown = capsys.readouterr().out
    assert "resuming: 1 hints already in" in shown and "; 2 others there were not written for this spec's" in shown
    assert "1 without problem_sha replaced" in shown
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["prompt_id"], r["hint"], r.get("problem_sha")) for r in rows} == {
        ("syn-0-0", "hard hint .", shas["syn-0-0"]), ("syn-0-1", "Work from left to right .", shas["syn-0-1"]),
        ("syn-0-2", "Work from left to right .", shas["syn-0-2"]),
        # another problem's hint is kept beside the new one, for the problem it was written for; the one without
        # problem_sha is replaced (training would take it for this spec's problem where the new one is missing)
        ("syn-0-1", "easy hint .", problem_sha(easy[1]["problem"]))}
    assert read_hint_variants(out)[("syn-0-1", 1)][shas["syn-0-1"]] == "Work from left to right ."


def test_sage_hints_with_failed_hints_exits_1_keeping_the_partial_file_and_the_old_one(monkeypatch, tmp_path,
                                                                                        capsys):
    """Hints the teacher gave no answer for (down, overloaded) fail the command: exit 1 saying how many, --out not
    written (a good file there stays, even with --force), the written hints kept in FILE.partial.jsonl; the same
    command again asks only for the failed ones and then writes --out."""
    from sage_core import cli

    _fast_retries(monkeypatch)
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    out, partial = tmp_path / "teacher.jsonl", tmp_path / "teacher.partial.jsonl"
    write_hints(out, [("syn-0-0", 1, "a good hint .")])
    good = out.read_text()
    args = ["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--out", str(out), "--force"]
    assert cli.main([*args, "--teacher", "http://127.0.0.1:9/v1"]) == 2  # nothing listens there: found at once
    err = capsys.readouterr().err
    assert "teacher endpoint http://127.0.0.1:9/v1 gives no answer to GET http://127.0.0.1:9/v1/models" in err
    assert out.read_text() == good and not partial.exists()
    down = [True]

    def answer(body):
        return (503, "overloaded") if down[0] and "level 2 hint" in body["messages"][-1]["content"] else \
            (200, "Work from left to right .")

    with _ChatEndpoint(answer) as teacher:
        assert cli.main([*args, "--teacher", teacher.url]) == 1
        assert "sage hints: 2 of 6 hints failed" in capsys.readouterr().err
        assert out.read_text() == good and set(read_hints(partial)) == {(f"syn-0-{i}", lv) for i in (0, 1)
                                                                           for lv in (1, 3)}
        down[0], asked = False, len(teacher.bodies)
        assert cli.main([*args, "--teacher", teacher.url]) == 0
        assert len(teacher.bodies) - asked == 2  # only the failed ones
    assert len(read_hints(out)) == 6 and not partial.exists()


def test_sage_hints_never_drops_the_hints_of_another_spec_in_the_partial_file(monkeypatch, tmp_path, capsys):
    """FILE.partial.jsonl left by `sage hints` for another spec (other prompt ids, another problem under one id):
    its hints stay in the file through every rewrite and go on into --out, and the messages count them truly; also
    where nothing is left to ask (the file was renamed as it was, and the count left the other spec's hints out)."""
    from sage_core import cli
    from sage_core.data import synthetic_rows

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    mine, theirs = synthetic_rows(2, seed=0), synthetic_rows(3, seed=1)
    hard = synthetic_rows(2, seed=0, difficulty="hard")  # the same prompt ids as `mine`, other problems
    out, partial = tmp_path / "teacher.jsonl", tmp_path / "teacher.partial.jsonl"
    other = [(r["prompt_id"], lv, f"their hint {r['prompt_id']} {lv} .", problem_sha(r["problem"]))
             for r in theirs for lv in (1, 2, 3)]
    other.append((hard[1]["prompt_id"], 1, "a hard problem's hint .", problem_sha(hard[1]["problem"])))
    write_hints(partial, [(mine[0]["prompt_id"], 1, "my hint .", problem_sha(mine[0]["problem"])), *other])

    def rows_of(path):
        return {(r["prompt_id"], r["level"], r["hint"], r.get("problem_sha"))
                for r in map(json.loads, path.read_text().splitlines())}

    args = ["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1", "--out", str(out),
            "--chunk", "1"]
    with _ChatEndpoint(lambda body: (200, "Work from left to right .")) as teacher:
        assert cli.main([*args, "--teacher", teacher.url]) == 0
    assert len(teacher.bodies) == 1  # only mine[1] at level 1
    shown = capsys.readouterr().out
    assert "resuming: 1 hints already in" in shown and "; 9 hints for prompt ids not in this spec: kept" in shown
    assert "; 1 others there were not written for this spec's problems" in shown  # the hard problem's: kept too
    assert f"wrote 2 hints for 2 prompts to {out}, with the 10 hints for other problems" in shown
    assert "(12 in all)" in shown
    assert set(other) <= rows_of(out) and len(rows_of(out)) == 12
    assert (mine[1]["prompt_id"], 1, "Work from left to right .", problem_sha(mine[1]["problem"])) in rows_of(out)
    # nothing left to ask: the file goes to --out whole, and the message counts what it holds
    out2 = tmp_path / "again.jsonl"
    out.rename(tmp_path / "again.partial.jsonl")
    args[args.index(str(out))] = str(out2)
    assert cli.main([*args, "--teacher", "http://127.0.0.1:9/v1"]) == 0  # nobody is asked
    shown = capsys.readouterr().out
    assert "wrote 2 hints for 2 prompts" in shown and "(12 in all)" in shown and len(rows_of(out2)) == 12
    # training on the other spec's prompts finds its hints there
    src = TeacherHints(str(out2))
    src.prepare(theirs, HintContext(generate=ScriptedModel([])))
    assert src.hints[(theirs[2]["prompt_id"], 3)] == f"their hint {theirs[2]['prompt_id']} 3 ."


def test_sage_hints_never_lets_a_hint_without_problem_sha_stand_for_this_specs_problem(monkeypatch, tmp_path,
                                                                                        capsys):
    """A hint without problem_sha under one of this spec's prompt ids is asked again; where the new one leaks, the
    old one is not left in --out for training to take as this problem's."""
    from sage_core import cli
    from sage_core.data import synthetic_rows

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    row = synthetic_rows(2, seed=0)[0]
    out = tmp_path / "teacher.jsonl"
    write_hints(tmp_path / "teacher.partial.jsonl", [(row["prompt_id"], 1, "OLD hint for some other problem .")])

    def answer(body):  # every sample for this row leaks
        leak = row["problem"] in body["messages"][-1]["content"]
        return 200, f"The answer is {row['answer']} ." if leak else "Work from left to right ."

    with _ChatEndpoint(answer) as teacher:
        assert cli.main(["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1",
                         "--out", str(out), "--teacher", teacher.url]) == 0
    assert "OLD hint" not in out.read_text()
    src = TeacherHints(str(out))
    src.prepare(synthetic_rows(2, seed=0), HintContext(generate=ScriptedModel([])))
    assert (row["prompt_id"], 1) not in src.hints


def test_sage_hints_keeps_a_hint_without_problem_sha_at_a_level_it_does_not_ask_for(monkeypatch, tmp_path, capsys):
    """--levels 1 over a file whose level-2 hint under this spec's prompt id has no problem_sha: that hint is neither
    asked again (its level is not asked for) nor dropped from --out, where it was lost."""
    from sage_core import cli
    from sage_core.data import synthetic_rows

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    row = synthetic_rows(2, seed=0)[0]
    out = tmp_path / "teacher.jsonl"
    write_hints(tmp_path / "teacher.partial.jsonl", [(row["prompt_id"], 2, "A level-2 hint written before .")])
    with _ChatEndpoint(lambda body: (200, "Work from left to right .")) as teacher:
        assert cli.main(["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1",
                         "--out", str(out), "--teacher", teacher.url]) == 0
    assert sum("Solution:" in b["messages"][-1]["content"] for b in teacher.bodies) == 2  # level 1 of both rows
    assert read_hint_variants(out)[(row["prompt_id"], 2)] == {None: "A level-2 hint written before ."}
    assert "without problem_sha replaced" not in capsys.readouterr().out


def test_teacher_paths_expand_home_and_take_hints_files_in_any_case(monkeypatch, tmp_path):
    """A teacher hints file named .JSONL is read as one (it was taken for a model: 'has no config.json'), and
    `~/h.jsonl` is found as data and model paths are."""
    from sage_core.data import synthetic_rows

    rows = synthetic_rows(2, seed=0)
    upper = tmp_path / "hints.JSONL"
    write_hints(upper, [(r["prompt_id"], 1, "Work from left to right .") for r in rows])
    assert len(TeacherHints(str(upper)).hints) == 2
    monkeypatch.setenv("HOME", str(tmp_path))
    write_hints(tmp_path / "h.jsonl", [(rows[0]["prompt_id"], 2, "Add first .")])
    assert TeacherHints("~/h.jsonl").hints == {(rows[0]["prompt_id"], 2): "Add first ."}
    with pytest.raises(DataError, match=r"teacher hints file not found: .*/nope\.jsonl"):
        TeacherHints("~/nope.jsonl")


def test_a_model_teacher_is_checked_at_once_and_loaded_only_when_asked(monkeypatch, tmp_path):
    """A teacher model path that is not there (or no model) fails at once naming the teacher, without loading
    anything; a good one is loaded on the first hint asked for, not when the source is built (before the policy)."""
    from sage_core import models
    from sage_core.models import ModelNotFound

    loads = []
    monkeypatch.setattr(models, "load_policy", lambda name, *a, **k: loads.append(name) or 1 / 0)
    with pytest.raises(ModelNotFound,
                       match=r"^teacher /nonexistent/teacher: model not found: .* does not exist .*a hints file"):
        TeacherHints("/nonexistent/teacher")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFound, match=r"^teacher .*empty: model folder .*empty has no config.json: not a saved "
                                            r"model.*a hints file"):
        TeacherHints(str(empty))
    folder = tmp_path / "teacher"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    src = TeacherHints("~/teacher")
    assert loads == []
    with pytest.raises(ZeroDivisionError):
        src.get([req()], HintContext(generate=ScriptedModel([])))
    assert loads == [str(folder)]


def test_an_endpoint_url_without_v1_says_so_on_a_404(monkeypatch):
    """A 404 that is not about the model (the URL lacks /v1) advises the base URL, not teacher_model; a 404 about the
    model still advises teacher_model."""
    _fast_retries(monkeypatch)
    with _ChatEndpoint(lambda body: (200, "Add first .")) as teacher, pytest.raises(
            TeacherError, match=r"HTTP 404: .*ends in /v1") as e:
        TeacherHints(teacher.url.removesuffix("/v1"), model="served").get([req()], HintContext(
            generate=ScriptedModel([])))
    assert "teacher_model" not in str(e.value)
    with _ChatEndpoint(lambda body: (404, "The model `x` does not exist.")) as teacher, pytest.raises(
            TeacherError, match=r"HTTP 404: .*does not exist.*set teacher_model"):
        TeacherHints(teacher.url, model="x").get([req()], HintContext(generate=ScriptedModel([])))


def test_a_numbered_list_hint_keeps_its_lines_and_is_no_leak_of_its_labels():
    """A hint written as a numbered list keeps each item on its own line (the others are joined by spaces), so its
    labels read as labels also where an item ends without a period: answer 2 is not in "2. Write an equation"."""
    raw = "1. Let n be the number\n2. Write an equation\n   \n3. Solve it\nfor n.\n4. Check\n5. Done\n6. Really\n7. Cut"
    assert clean_hint(raw) == "1. Let n be the number\n2. Write an equation\n3. Solve it for n.\n4. Check\n5. Done"
    got = sample_hints([req(answer="2")], HintContext(generate=ScriptedModel([raw])))
    assert got[0].text == clean_hint(raw) and not got[0].leaked


@pytest.mark.parametrize("row,needle", [
    ({"prompt_id": "a", "level": 1, "hint": 5}, r"row 0 has hint 5 \(int\); a hint is a string"),
    ({"prompt_id": "a", "level": 1, "hint": ["add"]}, r"row 0 has hint \['add'\] \(list\)"),
    ({"prompt_id": "a", "level": 1, "hint": {"text": "add"}}, r"row 0 has hint \{'text': 'add'\} \(dict\)"),
    ({"prompt_id": "a", "level": 1, "hint": True}, r"row 0 has hint True \(bool\)"),
    ({"prompt_id": "a", "level": True, "hint": "add"}, r"row 0 has level True; levels are"),
    ({"prompt_id": None, "level": 1, "hint": "add"}, r"row 0 has prompt_id None; a prompt id is a string or a number"),
    ({"prompt_id": " ", "level": 1, "hint": "add"}, r"row 0 has prompt_id ' '"),
])
def test_hints_of_the_wrong_type_are_data_errors_naming_the_file_and_row(tmp_path, row, needle):
    """A hint that is not text would be used as its repr ("5", "['add']"), a level true as level 1 and a null prompt
    id as the id "None": each is an error naming the file and the row, also for a teacher hints file."""
    path = tmp_path / "hints.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"hints\.jsonl: " + needle):
        read_hints(path)
    with pytest.raises(DataError, match=r"^teacher hints file .*hints\.jsonl: " + needle):
        TeacherHints(str(path))
    assert read_hints(_write(tmp_path / "ok.jsonl", {"prompt_id": 7, "level": 1, "hint": "add"})) == {("7", 1): "add"}


def _write(path, row):
    path.write_text(json.dumps(row) + "\n")
    return path


def _closed_port_url():
    """The URL of a loopback port nobody listens on (bound, then let go)."""
    import socket

    for port in _loopback_ports():
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"http://127.0.0.1:{port}/v1"
    raise OSError("no free loopback port in 18000-18999")


def test_an_endpoint_teacher_is_checked_when_built_before_any_hint_is_asked(monkeypatch):
    """Building the source (before the policy loads) asks the endpoint once: nothing there, a model it does not
    serve, a missing API key are errors saying what to change, not a run whose every hint fails. A server without
    /models, or one that takes any model name, passes on a one-token chat completion."""
    _fast_retries(monkeypatch)
    for var in ("SAGE_TEACHER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    url = _closed_port_url()
    with pytest.raises(TeacherError, match=rf"teacher endpoint {url} gives no answer to GET {url}/models \(waited 0s "
                                           r"for a server still starting, 1 try, the last: ConnectError.*"
                                           r"SAGE_TEACHER_STARTUP_WAIT=0 sets how many seconds\): is the server up"):
        TeacherHints(url, model="served")

    def vllm(body):  # vLLM refuses a model it does not serve
        return (200, "Add first .") if body["model"] in ("served", "lora-a") else \
            (404, f"The model `{body['model']}` does not exist.")

    with _ChatEndpoint(vllm, models=["served", "lora-a"]) as teacher:
        TeacherHints(teacher.url, model="served")
        assert teacher.bodies == []  # the model is listed: no completion asked
        with pytest.raises(TeacherError, match=r"serves \['served', 'lora-a'\], not 'qwen': set teacher_model"):
            TeacherHints(teacher.url, model="qwen")  # not listed, and its one-token completion is refused
    with _ChatEndpoint(lambda body: (404, f"The model `{body['model']}` does not exist."), models=["served"]) as t2:
        with pytest.raises(TeacherError, match=r"HTTP 404: .*does not exist.*serves \['served'\], not 'default', "
                                               r"sent because teacher_model is not set: set teacher_model"):
            TeacherHints(t2.url)
        assert len(t2.bodies) == 1 and t2.bodies[0]["max_tokens"] == 1
    with _ChatEndpoint(lambda body: (200, "Hi"), models=None) as bare:  # no /models (404): a completion decides
        TeacherHints(bare.url, model="anything")
        assert [b["model"] for b in bare.bodies] == ["anything"]
    with _ChatEndpoint(lambda body: (200, "Hi"), models=["model.gguf"]) as anyname:  # llama.cpp takes any name
        TeacherHints(anyname.url, model="qwen")
        assert len(anyname.bodies) == 1


def test_an_endpoint_teacher_sends_the_api_key_from_the_environment_and_a_refused_key_names_the_variable(
        monkeypatch, caplog):
    """The key is read from SAGE_TEACHER_API_KEY only and sent as a bearer token with every request; it is in no
    log. A user's OPENAI_API_KEY is never sent (the teacher URL may be anyone's, plain http). A 401/403 says which
    variable to set (or that the one set holds a refused key)."""
    _fast_retries(monkeypatch)
    for var in ("SAGE_TEACHER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    with _ChatEndpoint(lambda body: (200, "Add first ."), models=["served"]) as teacher, \
            caplog.at_level("DEBUG"):
        TeacherHints(teacher.url, model="served").get([req()], HintContext(generate=ScriptedModel([])))
        monkeypatch.setenv("SAGE_TEACHER_API_KEY", "sage-secret")
        TeacherHints(teacher.url, model="served").get([req(pid="p2")], HintContext(generate=ScriptedModel([])))
    assert [a for _, a in teacher.auth] == [None] * 2 + ["Bearer sage-secret"] * 2
    assert "secret" not in caplog.text
    with _ChatEndpoint(lambda body: (401, "Unauthorized"), models=["served"]) as teacher:
        # vllm serve --api-key: /v1/models wants the key too
        teacher.server.RequestHandlerClass.do_GET = lambda self: self.send(401, b'{"error": "Unauthorized"}')
        with pytest.raises(TeacherError, match=r"HTTP 401: .*read from SAGE_TEACHER_API_KEY: is it the right key"):
            TeacherHints(teacher.url, model="served")
        monkeypatch.delenv("SAGE_TEACHER_API_KEY")
        monkeypatch.delenv("OPENAI_API_KEY")
        with pytest.raises(TeacherError, match=r"HTTP 401: .*wants an API key: set SAGE_TEACHER_API_KEY to it; "
                                               r"OPENAI_API_KEY is never sent to a teacher"):
            TeacherHints(teacher.url, model="served")


def test_an_endpoint_that_hangs_trickles_or_stays_down_costs_one_bounded_try_per_hint(monkeypatch, caplog):
    """A request has `timeout` seconds in all, its tries included, also against a server that trickles its reply a
    byte at a time (httpx's own timeout is per read); a hint the endpoint never answered is failed, not resampled;
    and once the first wave of a call's requests all went unanswered, the rest of that call are not sent."""
    import time
    from functools import partial

    from sage_core import hints

    def trickle(handler):  # headers, then one byte every 50 ms, never the whole body
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(200):
            try:
                handler.wfile.write(b" ")
                handler.wfile.flush()
            except OSError:
                return
            time.sleep(0.05)

    monkeypatch.setattr(hints, "_openai_generate", partial(hints._openai_generate, backoff=0.01, timeout=0.5))
    with _ChatEndpoint(lambda body: trickle) as slow:
        start = time.monotonic()
        got = TeacherHints(slow.url).get([req()], HintContext(generate=ScriptedModel([]), retries=2))
        took = time.monotonic() - start
    assert got[0].failed and not got[0].leaked and len(slow.bodies) == 1 and took < 5
    assert "1 of 1 hint requests got no answer" in caplog.text and "ReadTimeout" in caplog.text

    def trickle_head(handler):  # the status line and headers a byte every 50 ms: never a whole head
        for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" * 20:
            try:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            except OSError:
                return
            time.sleep(0.05)

    caplog.clear()
    with _ChatEndpoint(lambda body: trickle_head) as slow:
        start = time.monotonic()
        got = TeacherHints(slow.url).get([req()], HintContext(generate=ScriptedModel([]), retries=2))
        took = time.monotonic() - start
    assert got[0].failed and len(slow.bodies) == 1 and took < 5  # it held the request for 50 s before
    assert "1 of 1 hint requests got no answer" in caplog.text and "ReadTimeout" in caplog.text

    caplog.clear()
    monkeypatch.setattr(hints, "_openai_generate", partial(hints._openai_generate, backoff=0.01, concurrency=2))
    reqs = [req(pid=f"p{i}") for i in range(10)]
    with _ChatEndpoint(lambda body: (503, "overloaded")) as down:
        got = TeacherHints(down.url).get(reqs, HintContext(generate=ScriptedModel([]), retries=2))
    assert all(r.failed for r in got) and len(down.bodies) <= 15  # the first wave (2 x 3 tries), not 10 x 3
    assert caplog.text.count("hint requests got no answer") == 1  # warned once for the call
    assert "10 of 10 hint requests got no answer" in caplog.text and "the first 2 all went unanswered" in caplog.text


@pytest.mark.parametrize("reply", [b"<html><body>502 Bad Gateway</body></html>", b'{"choices": [', b'{"choices": []}',
                                   b'{"choices": [{"message": {"content": ["a", "list"]}}]}'])
def test_a_reply_that_is_no_chat_completion_is_retried_then_a_failed_hint(monkeypatch, caplog, reply):
    """A 200 whose body is no chat completion (a proxy's page, a cut reply, no choices) is tried again like a 5xx,
    then counts as a failed hint: the run goes on."""
    _fast_retries(monkeypatch)
    with _ChatEndpoint(lambda body: (200, reply)) as teacher:
        got = TeacherHints(teacher.url).get([req()], HintContext(generate=ScriptedModel([]), retries=2))
    assert got[0].failed and len(teacher.bodies) == 3
    assert "HTTP 200, not a chat completion" in caplog.text


def test_an_empty_reply_is_resampled_and_a_refused_key_mid_run_names_the_variable(monkeypatch):
    """An empty hint (null content) is a real answer: resampled, as a policy's empty hint is. A 401 after the check
    (a key revoked) stops the run, saying where the key is read from."""
    _fast_retries(monkeypatch)
    for var in ("SAGE_TEACHER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    replies = iter([None, None, "Add first ."])
    with _ChatEndpoint(lambda body: (200, next(replies))) as teacher:
        got = TeacherHints(teacher.url).get([req()], HintContext(generate=ScriptedModel([]), retries=2))
    assert got[0].text == "Add first ." and len(teacher.bodies) == 3
    with _ChatEndpoint(lambda body: (401, "Unauthorized")) as teacher, pytest.raises(
            TeacherError, match=r"HTTP 401: .*wants an API key: set SAGE_TEACHER_API_KEY"):
        TeacherHints(teacher.url).get([req()], HintContext(generate=ScriptedModel([])))


def test_sage_hints_where_every_hint_leaked_exits_1_writing_no_file(monkeypatch, tmp_path, capsys):
    """Every hint the teacher wrote gave the answer away: no hints file is written (it would hold none of the hints
    asked for) and the command exits 1 saying so, not "wrote 0 hints"."""
    from sage_core import cli
    from sage_core.data import synthetic_rows

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    rows = synthetic_rows(2, seed=0)

    def answer(body):
        problem = body["messages"][-1]["content"]
        return 200, "The answer is " + next(r["answer"] for r in rows if r["problem"] in problem) + " ."

    out = tmp_path / "teacher.jsonl"
    with _ChatEndpoint(answer) as teacher:
        assert cli.main(["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1",
                         "--out", str(out), "--teacher", teacher.url]) == 1
    err = capsys.readouterr().err
    assert "sage hints: every one of the 2 hints asked for leaked" in err and f"{out} was not written" in err
    assert not out.exists() and len(teacher.bodies) == 2 * 3  # each sampled and resampled twice


def test_sage_train_with_an_endpoint_teacher_nobody_serves_exits_2_before_the_policy_loads(monkeypatch, tmp_path,
                                                                                           capsys):
    """`sage train` builds its hint source before the policy, so an endpoint that is not there is an error naming
    the URL at once, not a run of plain GRPO with every hint failed."""
    from sage_core import cli, train

    _fast_retries(monkeypatch)
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(train, "_trainer_inputs", lambda *a: pytest.fail("the policy loaded"))
    url = _closed_port_url()
    assert cli.main(["train", "--set", "num_prompts=4", "--set", "prompts_per_step=4", "--set", "max_steps=1",
                     "--set", "hint_source=teacher", "--set", f"teacher={url}", "--output-dir",
                     str(tmp_path / "run")]) == 2
    assert f"sage train: teacher endpoint {url} gives no answer to GET {url}/models" in capsys.readouterr().err


def test_a_finished_run_with_an_endpoint_teacher_run_again_does_not_need_the_endpoint(monkeypatch, tmp_path,
                                                                                    tiny_model_dir):
    """A run that is done trains nothing when run again (a requeued job, a flow re-run after its evaluation crashed):
    its teacher server, shut down since, is not asked whether it is up (that would wait SAGE_TEACHER_STARTUP_WAIT,
    then fail a run with nothing to do)."""
    from sage_core.presets import preset
    from sage_core.train import train

    _fast_retries(monkeypatch)
    with _ChatEndpoint(lambda body: (200, "Add the two numbers first.")) as server:
        spec = preset("tiny-cpu").model_copy(update=dict(
            method="sage", hint_source="teacher", teacher=server.url, num_prompts=4, prompts_per_step=4,
            max_steps=1, save_steps=1))
        first = train(spec, tmp_path / "run")
    assert first.global_step == 1 and server.bodies  # the teacher wrote hints while it trained
    again = train(spec, tmp_path / "run")  # the server is gone: nothing to train, nothing asked
    assert again.global_step == 1 and (tmp_path / "run" / "final").is_dir()


def _redirect_to(location, status=307):
    """A reply (for _ChatEndpoint) that redirects to `location`, as an http -> https redirect or an ingress does."""
    def reply(handler):
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return reply


def test_an_endpoint_that_redirects_or_answers_with_no_chat_completion_fails_its_check(monkeypatch, caplog):
    """A 3xx (redirects are not followed) names where it leads; a 2xx that is no chat completion (a login page) quotes
    what came back: either fails the check, not a run whose every hint fails. A redirect met later is reported with
    its own status."""
    _fast_retries(monkeypatch)
    to = "https://127.0.0.1:1/v1/chat/completions"
    with _ChatEndpoint(lambda body: _redirect_to(to), models=None) as teacher:
        with pytest.raises(TeacherError, match=r"the endpoint redirects to https://127\.0\.0\.1:1/v1/chat/completions "
                                               r"\(HTTP 307 .*give that URL: teacher=https://127\.0\.0\.1:1/v1$"):
            TeacherHints(teacher.url, model="served")
        teacher.server.RequestHandlerClass.do_GET = lambda self: _redirect_to("https://127.0.0.1:1/v1/models", 301)(
            self)  # every path redirects: /models too
        with pytest.raises(TeacherError, match=r"redirects to https://127\.0\.0\.1:1/v1/chat/completions"):
            TeacherHints(teacher.url, model="served")
    with _ChatEndpoint(lambda body: _redirect_to("/login?next=/v1"), models=None) as teacher, pytest.raises(
            TeacherError, match=r"redirects to http://127\.0\.0\.1:\d+/login\?next=/v1 .*not to the same API path"):
        TeacherHints(teacher.url, model="served")
    with _ChatEndpoint(lambda body: (200, b"<html>login page</html>"), models=None) as teacher, pytest.raises(
            TeacherError, match=r"HTTP 200 and no chat completion: '<html>login page</html>'"):
        TeacherHints(teacher.url, model="served")
    # the check passed (/models lists the model), the chat requests redirect: reported as the 307 they are
    with _ChatEndpoint(lambda body: _redirect_to(to), models=["served"]) as teacher:
        got = TeacherHints(teacher.url, model="served").get([req()], HintContext(generate=ScriptedModel([])))
    assert got[0].failed and f"HTTP 307, a redirect to {to}" in caplog.text and "HTTP 200" not in caplog.text


def test_an_endpoint_still_starting_is_waited_for(monkeypatch, caplog):
    """`vllm serve ... &` then `sage launch`: a server refusing connections, or answering 503 while its model loads,
    is asked again every TEACHER_STARTUP_POLL seconds for up to SAGE_TEACHER_STARTUP_WAIT seconds (600 unset),
    saying so every TEACHER_STARTUP_LOG seconds; past the wait the error says how long it waited and where to set it."""
    import threading
    import time

    from sage_core import hints

    _fast_retries(monkeypatch)
    monkeypatch.setattr(hints, "TEACHER_STARTUP_POLL", 0.05)
    monkeypatch.setenv("SAGE_TEACHER_STARTUP_WAIT", "20")
    ready = time.monotonic() + 0.5

    def loading(handler):  # llama.cpp while its model loads
        handler.send(503, b'{"error": {"code": 503, "message": "Loading model"}}')

    with _ChatEndpoint(lambda body: (200, "Hi") if time.monotonic() > ready else loading, models=None) as teacher:
        TeacherHints(teacher.url, model="served")
        assert len(teacher.bodies) > 2
    assert f"waiting for the teacher at {teacher.url} (HTTP 503: " in caplog.text and "Loading model" in caplog.text
    assert caplog.text.count("waiting for the teacher at") == 1  # every 30 s, not every try

    # nothing listens yet: the server comes up on that port a moment later
    caplog.clear()
    url = _closed_port_url()
    port = int(url.split(":")[2].split("/")[0])
    servers = []
    later = threading.Timer(0.4, lambda: servers.append(_ChatEndpoint(lambda body: (200, "Hi"), port=port)))
    later.start()
    try:
        TeacherHints(url)
    finally:
        later.join()
        for s in servers:
            s.__exit__(None, None, None)
    assert "waiting for the teacher at" in caplog.text and "ConnectError" in caplog.text

    monkeypatch.setenv("SAGE_TEACHER_STARTUP_WAIT", "0.3")
    with pytest.raises(TeacherError, match=r"gives no answer to GET .*/models \(waited 0s for a server still starting, "
                                           r"\d+ tries, the last: ConnectError.*SAGE_TEACHER_STARTUP_WAIT=0\.3 sets"):
        TeacherHints(_closed_port_url())
    monkeypatch.setenv("SAGE_TEACHER_STARTUP_WAIT", "soon")
    with pytest.raises(TeacherError, match=r"SAGE_TEACHER_STARTUP_WAIT='soon': the seconds to wait"):
        TeacherHints(_closed_port_url())
    monkeypatch.delenv("SAGE_TEACHER_STARTUP_WAIT")
    assert hints.TEACHER_STARTUP_WAIT == 600 and hints._startup_wait() == 600
    assert (hints.TEACHER_STARTUP_POLL, hints.TEACHER_STARTUP_LOG) == (0.05, 30)


def test_a_hint_whose_resample_went_unanswered_after_a_leak_failed(monkeypatch, tmp_path, capsys):
    """The greedy sample leaked, the resample got no answer (the endpoint went down): the hint is unanswered, so
    `sage hints` counts it failed, not leaked: no --out, exit 1, and the command again asks for it."""
    from sage_core import cli
    from sage_core.data import synthetic_rows

    got = sample_hints([req()], HintContext(generate=ScriptedModel(["12 - 3 = 9 .", None]), retries=2))
    assert got[0].failed and got[0].leaked and got[0].unanswered and got[0].attempts == 2
    got = sample_hints([req()], HintContext(generate=ScriptedModel(["= 9"] * 3), retries=2))
    assert got[0].leaked and not got[0].unanswered  # leaked every time: a leak

    _fast_retries(monkeypatch)
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    rows = synthetic_rows(2, seed=0)
    down = [True]

    def answer(body):  # the first problem's greedy hint leaks, its resamples meet a server gone down
        first = rows[0]["problem"] in body["messages"][-1]["content"]
        if first and body["temperature"] == 0:
            return 200, f"The answer is {rows[0]['answer']} ."
        return (503, "down") if first and down[0] else (200, "Work from left to right .")

    out = tmp_path / "teacher.jsonl"
    args = ["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1", "--out", str(out)]
    with _ChatEndpoint(answer) as teacher:
        assert cli.main([*args, "--teacher", teacher.url]) == 1
        err = capsys.readouterr().err
        assert "sage hints: 1 of 2 hints failed" in err and "(1 failed, 0 leaked)" in err and not out.exists()
        down[0] = False
        assert cli.main([*args, "--teacher", teacher.url]) == 0  # asked again: its resample is written
    assert len(read_hints(out)) == 2

    # every hint leaked, then went unanswered: failed, not "every one of the hints leaked"
    out.unlink()
    def leak_then_down(body):
        row = next(r for r in rows if r["problem"] in body["messages"][-1]["content"])
        return (200, f"The answer is {row['answer']} .") if body["temperature"] == 0 else (503, "down")

    with _ChatEndpoint(leak_then_down) as teacher:
        assert cli.main([*args, "--teacher", teacher.url]) == 1
    err = capsys.readouterr().err
    assert "sage hints: 2 of 2 hints failed" in err and "every one of" not in err and not out.exists()


def test_a_hung_endpoint_costs_one_deadline_a_call_and_is_used_again_once_back(monkeypatch, caplog):
    """A server that takes requests and never answers: a call's first wave times out together and the others are
    never sent (no second deadline for the next wave); the next call sends one request first and the rest only once
    it is answered, so a server back up writes every hint again."""
    import threading
    import time

    from sage_core import hints

    hung, released = [True], threading.Event()

    def answer(body):
        if not hung[0]:
            return 200, "Add first ."

        def reply(handler):  # never answers in time; let go when the test ends
            released.wait(10)
            try:
                handler.send(200, b'{"choices": [{"message": {"content": "late"}}]}')
            except OSError:
                pass
        return reply

    prompts = [[{"role": "user", "content": f"Problem {i}"}] for i in range(6)]
    with _ChatEndpoint(answer) as teacher:
        try:
            generate = hints._openai_generate(teacher.url, None, concurrency=2, backoff=0.01, timeout=0.5)
            start = time.monotonic()
            assert generate(prompts, 8, 0.0) == [None] * 6
            took = time.monotonic() - start
            assert len(teacher.bodies) == 2 and took < 0.9  # the first wave only, within one deadline
            assert "the first 2 all went unanswered, so 4 were not sent" in caplog.text
            assert generate(prompts, 8, 0.0) == [None] * 6
            assert len(teacher.bodies) == 3  # one request first; unanswered, the others are not sent
            assert "so one request was sent first and, unanswered, the 5 others were not sent" in caplog.text
            hung[0] = False
            assert generate(prompts, 8, 0.0) == ["Add first ."] * 6  # back up: used again, all of it
            assert len(teacher.bodies) == 3 + 6
            assert generate(prompts, 8, 0.0) == ["Add first ."] * 6 and teacher.most == 2
        finally:
            released.set()


def test_sage_hints_stops_after_a_chunk_the_teacher_answered_none_of(monkeypatch, tmp_path, capsys):
    """A teacher down after the check: the first chunk goes unanswered and the rest are not asked for (each chunk
    would wait on it again); the command exits 1 saying so, and the same command later asks for all of them."""
    from sage_core import cli

    _fast_retries(monkeypatch)
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    out = tmp_path / "teacher.jsonl"
    with _ChatEndpoint(lambda body: (503, "overloaded")) as teacher:
        assert cli.main(["hints", "--set", "num_prompts=4", "--set", "prompts_per_step=4", "--levels", "1", "--out",
                         str(out), "--chunk", "2", "--teacher", teacher.url]) == 1
    err = capsys.readouterr().err
    assert "sage hints: 2 of 4 hints failed" in err and "so the other 2 hints were not asked for" in err
    assert len(teacher.bodies) == 2 * 3 and not out.exists()  # the first chunk's 2 requests, 3 tries each


def test_sage_hints_never_resumes_a_partial_file_another_teacher_began(monkeypatch, tmp_path, capsys):
    """Each row `sage hints` writes names its teacher; a run with another teacher is refused before it asks anything,
    the partial file unchanged, where it would have mixed the two teachers' hints in one file. The same teacher
    resumes, and rows written before hints were labelled (no teacher) are taken as they are."""
    from sage_core import cli

    _fast_retries(monkeypatch)
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    out, partial = tmp_path / "teacher.jsonl", tmp_path / "teacher.partial.jsonl"
    args = ["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1", "--out", str(out),
            "--chunk", "1"]
    with _ChatEndpoint(lambda body: (200, "Work from left to right .") if len(first.bodies) == 1
                       else (400, "quota exhausted")) as first:
        assert cli.main([*args, "--teacher", first.url + "/"]) == 2  # one hint written, then refused
        capsys.readouterr()
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    assert [r["teacher"] for r in rows] == [first.url]  # the URL, without its trailing /
    before = partial.read_bytes()
    with _ChatEndpoint(lambda body: (200, "Add them up .")) as second:
        assert cli.main([*args, "--teacher", second.url, "--teacher-model", "m"]) == 2
        err = capsys.readouterr().err
        assert f"holds hints written by another teacher ({first.url}), and this command's teacher is " \
               f"{second.url} (model m)" in err and "move" in err
        assert second.bodies == [] and partial.read_bytes() == before and not out.exists()
        # a file without teacher labels (written before them, or by hand) is resumed by any teacher
        partial.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "teacher"}) + "\n" for r in rows))
        assert cli.main([*args, "--teacher", second.url, "--teacher-model", "m"]) == 0
    got = {r["prompt_id"]: r.get("teacher") for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(got.values(), key=str) == [None, f"{second.url} (model m)"]
    assert sum("Solution:" in b["messages"][-1]["content"] for b in second.bodies) == 1  # the one hint not there


def test_a_tls_endpoint_that_trickles_its_reply_head_is_cut_off_at_the_deadline(tmp_path):
    """Over https the socket _send shuts down at the deadline is the TLS one (the TCP socket under it is detached):
    the request ends at its deadline with a ReadTimeout, not 50 s later, nor with an error from inside ssl."""
    import datetime
    import socket
    import ssl
    import threading
    import time

    import httpx
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from sage_core import hints

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address(
                "127.0.0.1"))]), critical=False).sign(key, hashes.SHA256()))
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def trickle(conn):
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                s.recv(65536)
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: yes\r\n" * 40:
                    s.send(bytes([byte]))
                    time.sleep(0.05)
        except OSError:
            pass

    def accept():
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=trickle, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    client = httpx.Client(verify=ssl.create_default_context(cafile=str(tmp_path / "c.pem")),
                          limits=httpx.Limits(max_keepalive_connections=0))
    try:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match="still coming at the deadline"):
            hints._send(client, "POST", f"https://127.0.0.1:{port}/v1/chat/completions", time.monotonic() + 0.5, {})
        assert time.monotonic() - start < 3
    finally:
        client.close()
        listener.close()


def test_sage_hints_refuses_a_teacher_url_with_a_password(monkeypatch, tmp_path, capsys):
    """`sage hints --teacher URL` builds no RunSpec with it: a URL with a user and password was asked (httpx sent them
    as basic auth) and written, as each row's teacher, into every row of the hints file, and into every message; it
    is refused before the teacher is asked, naming SAGE_TEACHER_API_KEY."""
    from sage_core import cli

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    out = tmp_path / "teacher.jsonl"
    with _ChatEndpoint(lambda body: (200, "Add first .")) as teacher:
        url = teacher.url.replace("http://", "http://alice:s3cret@")
        code = cli.main(["hints", "--set", "num_prompts=2", "--set", "prompts_per_step=2", "--levels", "1",
                         "--out", str(out), "--teacher", url])
    err = capsys.readouterr().err
    assert code == 2 and "no user, password or query" in err and "SAGE_TEACHER_API_KEY" in err
    assert "s3cret" not in err and teacher.auth == [] and teacher.bodies == [] and not out.exists()
