"""Math answer extraction and grading.

``extract_answer`` pulls the answer a response commits to: the last ``\\boxed{...}`` (nested braces
allowed), else GSM8K's ``#### N``, else the last number ("the answer is X" on request).
``is_equivalent`` compares it with the reference: normalised strings, then exact numbers
(``1,000`` = ``1000``, ``$5.`` = ``5``, ``\\frac{1}{2}`` = ``0.5``, ``50%`` = ``50`` = ``0.5``),
then, for anything symbolic, math-verify (``pip install 'headrace[tasks]'``) when installed.

math-verify bounds its sympy work with ``signal.alarm``, which only works on the main thread; on
any other thread it is called with its timeouts off, so answers that can make sympy run away
(power towers, huge factorials, very long strings) are refused before it sees them, on every thread.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import anyio

try:
    import math_verify
except ImportError:  # optional: numbers are graded without it
    math_verify = None


class _QuietTimeoutWarning(logging.Filter):
    # math-verify warns once that with its timeouts off "you must provide" one: _risky is ours
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())

ALL_METHODS = ("boxed", "hash", "answer_is", "last_number")
METHODS = ("boxed", "hash", "last_number")  # the default order
MAX_SYMBOLIC_CHARS = 200

_NUMBER = r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-−]?\.\d+"
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.])(?:{_NUMBER})(?:\s*/\s*\d+|\s*\\?%)?")
_HASH = re.compile(r"####\s*(.+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_BOXED_BARE = re.compile(r"[^\s${}]+")


@dataclass(frozen=True)
class Grade:
    """``extracted``: the answer found in the response (None: none found); ``method``: which rule
    found it (one of ``METHODS``, or "none"); ``checker``: what decided (``string``, ``numeric``,
    ``math_verify``, ``refused`` for a guarded answer, ``none``)."""

    correct: bool
    extracted: str | None
    method: str
    checker: str


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or of
    ``\\boxed 5``; None when there is none or its braces never close."""
    found: dict[int, str] = {}  # start of the content -> content
    braced = set()
    for match in _BOXED.finditer(text):
        if match.group(1) is not None:
            braced.add(match.end())
        elif rest := _BOXED_BARE.match(text, match.end()):  # \boxed 5: up to a space or $
            found[match.end()] = rest.group()
    if braced:  # one pass over the braces, so a thousand unclosed boxes cost no more than one
        stack = []
        for i, char in enumerate(text):
            if char == "{":
                stack.append(i + 1)
            elif char == "}" and stack and (start := stack.pop()) in braced:
                found[start] = text[start:i]
    return found[max(found)].strip() if found else None


def extract_hash(text: str) -> str | None:
    """What follows the last ``####`` on its line (GSM8K's answer marker)."""
    matches = _HASH.findall(text)
    return matches[-1].strip() if matches else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (``1,234.5``, ``-3``, ``3/4``, ``50%``), as written."""
    matches = _NUMBER_IN_TEXT.findall(text)
    return matches[-1].replace(" ", "") if matches else None


def extract_answer(text: str, methods: Sequence[str] = METHODS) -> tuple[str | None, str]:
    """``(answer, method)`` by the first of ``methods`` that finds one; ``(None, "none")`` if none."""
    for method in methods:
        if method == "boxed":
            found = extract_boxed(text)
        elif method == "hash":
            found = extract_hash(text)
        elif method == "answer_is":
            matches = _ANSWER_IS.findall(text)
            found = matches[-1].strip() if matches else None
        elif method == "last_number":
            found = extract_last_number(text)
        else:
            raise ValueError(f"unknown answer extraction method {method!r}; use any of {', '.join(ALL_METHODS)}")
        if found:
            return found, method
    return None, "none"


def normalize(answer: str) -> str:
    """A canonical spelling: no spaces, ``$``, ``\\left``/``\\right``, ``\\text{}`` wrappers,
    trailing period or unit words; ``\\dfrac``/``\\tfrac`` as ``\\frac``; ``−`` as ``-``."""
    s = answer.strip().replace("−", "-").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = re.sub(r"\\(?:left|right)\b", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{\s*([^{}]*)\}", r"\1", s)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"^(?:[a-zA-Z]\s*=\s*)", "", s)  # x = 5
    s = re.sub(rf"^({_NUMBER}|\\frac\{{\d+\}}\{{\d+\}})\s+[a-zA-Z][a-zA-Z ]*$", r"\1", s)  # 18 dollars
    s = s.rstrip(".").strip()
    return re.sub(r"\s+", "", s)


def parse_number(answer: str) -> set[Fraction] | None:
    """The exact values a numeric answer may mean: ``{x}``, or ``{x, x/100}`` for a percentage;
    None when it is not a plain number, decimal or fraction."""
    s = normalize(answer)
    percent = s.endswith("%")
    s = s.removesuffix("\\%").removesuffix("%")
    frac = re.fullmatch(r"(-?)\\frac(?:\{(-?\d+)\}\{(\d+)\}|(\d)(\d))", s)
    try:
        if frac:
            num, den = (frac.group(2), frac.group(3)) if frac.group(2) else (frac.group(4), frac.group(5))
            value = Fraction(int(num), int(den)) * (-1 if frac.group(1) else 1)
        elif re.fullmatch(rf"(?:{_NUMBER})(?:/\d+)?", s):
            number, _, den = s.partition("/")
            value = Fraction(number.replace(",", "")) / (int(den) if den else 1)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return {value, value / 100} if percent else {value}


def _numbers_equal(a: set[Fraction], b: set[Fraction]) -> bool:
    # exact, or equal at 6 decimals (as math-verify's float_rounding) so 0.333333 matches 1/3
    def close(x: Fraction, y: Fraction) -> bool:
        try:
            return round(float(x), 6) == round(float(y), 6)
        except OverflowError:  # beyond floats: exact only
            return False

    return any(x == y or close(x, y) for x in a for y in b)


def _risky(answer: str) -> bool:
    """Answers that can make sympy compute for minutes (and that no grader thread can stop)."""
    return (
        len(answer) > MAX_SYMBOLIC_CHARS
        or re.search(r"\^\s*\{[^{}]*\^|\^\s*\(?[^\s{}]*\^", answer) is not None  # power towers
        or re.search(r"\^\s*\{?\s*\d{4,}", answer) is not None  # huge exponents
        or re.search(r"\d{3,}\s*!", answer) is not None  # huge factorials
    )


def _math_verify(pred: str, gold: str, timeout_s: int) -> bool:
    on_main = threading.current_thread() is threading.main_thread()
    timeout = timeout_s if on_main else None  # signal.alarm raises off the main thread
    gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = math_verify.parse(f"${pred}$", parsing_timeout=timeout)
    return bool(gold_parsed and pred_parsed and math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def check(pred: str, gold: str, *, timeout_s: int = 5) -> tuple[bool, str]:
    """``(equal, checker)``: whether the answer ``pred`` equals the reference ``gold``."""
    if normalize(pred) == normalize(gold):
        return True, "string"
    pred_num, gold_num = parse_number(pred), parse_number(gold)
    if pred_num is not None and gold_num is not None:
        return _numbers_equal(pred_num, gold_num), "numeric"
    if math_verify is None:
        return False, "none"
    if _risky(pred):
        return False, "refused"
    return _math_verify(pred.replace("$", ""), gold.replace("$", ""), timeout_s), "math_verify"


def is_equivalent(pred: str, gold: str, *, timeout_s: int = 5) -> bool:
    return check(pred, gold, timeout_s=timeout_s)[0]


def grade(response: str, gold: str, *, methods: Sequence[str] = METHODS, timeout_s: int = 5) -> Grade:
    """Extract the answer ``response`` commits to and compare it with ``gold`` (an answer, not a
    solution: run ``extract_answer`` on a reference solution first)."""
    extracted, method = extract_answer(response, methods)
    if extracted is None:
        return Grade(False, None, method, "none")
    correct, checker = check(extracted, gold, timeout_s=timeout_s)
    return Grade(correct, extracted, method, checker)


async def grade_async(response: str, gold: str, *, methods: Sequence[str] = METHODS, timeout_s: int = 5) -> Grade:
    """``grade`` on a worker thread, so a symbolic comparison never blocks the event loop; past
    ``timeout_s`` the answer counts as wrong (checker ``timeout``) and the thread is abandoned."""
    with anyio.move_on_after(timeout_s):
        return await anyio.to_thread.run_sync(
            lambda: grade(response, gold, methods=methods, timeout_s=timeout_s), abandon_on_cancel=True
        )
    return Grade(False, *extract_answer(response, methods), "timeout")


def symbolic_available() -> bool:
    return math_verify is not None


__all__ = [
    "ALL_METHODS",
    "METHODS",
    "Grade",
    "check",
    "extract_answer",
    "extract_boxed",
    "extract_hash",
    "extract_last_number",
    "grade",
    "grade_async",
    "is_equivalent",
    "normalize",
    "parse_number",
    "symbolic_available",
]
