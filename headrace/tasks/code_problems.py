"""Generated Python programming problems with hidden unit tests, in five families of rising
difficulty: ``constant`` (return a value), ``arithmetic`` (of the arguments), ``strings``,
``lists`` (comprehensions, filters) and ``algorithms`` (small loops: primes, gcd, Fibonacci...).

A template draws its parameters (``k`` in "returns x plus k"), a reference solution computes the
expected value of each generated input, and the tests are ``call == expected`` pairs of
literals. ``generate(index, split=, families=)`` is a pure function of its arguments.

The held-out split is chosen by a hash of the problem's *key* (template and parameters, not the
cosmetic function name), so a test problem never appears in training under another name; a
template without parameters is wholly in one split. Each split draws candidates until one lands
in it. Templates with an ``expression`` (a one-line body of digits, letters and ``+-*/()``) also
have the bare form the embedded tiny model's alphabet can write: ``def f(x): return x+3``.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from headrace.tasks.word_math import split_of

FAMILIES = ("constant", "arithmetic", "strings", "lists", "algorithms")
BARE_FAMILIES = ("constant", "arithmetic")  # the ones with bodies the tiny alphabet can write
WORDS = tuple(
    "apple banana cherry kiwi lemon mango peach plum grape melon code python "
    "level noon racecar abba hello world data model river stone Tiger Moon".split()
)
PHRASES: tuple[str, ...] = ("the quick fox", "hello world", "a b c", "one two three four", "red green", "go")
PHRASES += ("keep it simple", "data beats ideas", "small steps win", "x", "to be or not to be", "python is fun")


@dataclass(frozen=True)
class Spec:
    """One template's draw: what the function is called, takes and returns, and the truth."""

    function: str
    params: tuple[str, ...]
    says: str  # "returns x plus 3": the sentence after "Write a function that"
    solve: Callable[..., Any]
    inputs: Callable[[random.Random], tuple]
    key: str  # template and parameters: what the held-out split hashes
    expression: str | None = None  # the body as one expression in the tiny alphabet, if it has one


@dataclass(frozen=True)
class Case:
    call: str  # "add(3)"
    expected: str  # a literal: "5", "'abc'", "[1, 2]"


@dataclass(frozen=True)
class CodeProblem:
    family: str
    template: str
    function: str
    params: tuple[str, ...]
    says: str
    tests: tuple[Case, ...]  # hidden
    examples: tuple[Case, ...]  # shown in the prompt
    expression: str | None
    split: str

    @property
    def signature(self) -> str:
        return f"def {self.function}({', '.join(self.params)}):"


Template = Callable[[random.Random], Spec]


def _ints(lo: int, hi: int, n: int = 1) -> Callable[[random.Random], tuple]:
    return lambda rng: tuple(rng.randint(lo, hi) for _ in range(n))


def _list(lo: int = -9, hi: int = 20, min_len: int = 0, max_len: int = 7) -> Callable[[random.Random], tuple]:
    return lambda rng: ([rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))],)


def _word(rng: random.Random) -> tuple:
    return (rng.choice(WORDS),)


def _phrase(rng: random.Random) -> tuple:
    return (rng.choice(PHRASES),)


def _x(
    name: str, says: str, solve: Callable[..., Any], key: str, expr: str | None, lo: int = -20, hi: int = 50
) -> Spec:
    return Spec(name, ("x",), says, solve, _ints(lo, hi), key, expr)


def _xy(name: str, says: str, solve: Callable[..., Any], key: str, expr: str | None) -> Spec:
    return Spec(name, ("x", "y"), says, solve, _ints(-20, 50, 2), key, expr)


def _constants(rng: random.Random) -> list[Spec]:
    k, a, b, w = rng.randint(0, 99), rng.randint(1, 9), rng.randint(1, 9), rng.choice(WORDS).lower()
    items = [rng.randint(0, 9) for _ in range(3)]
    none = lambda rng: ()  # noqa: E731 - a constant takes no arguments
    return [
        Spec("answer", (), f"returns the integer {k}", lambda: k, none, f"int/{k}", str(k)),
        Spec("total", (), f"returns {a} plus {b}", lambda: a + b, none, f"sum/{a}/{b}", f"{a}+{b}"),
        Spec("greeting", (), f"returns the string '{w}'", lambda: w, none, f"str/{w}"),
        Spec("numbers", (), f"returns the list {items}", lambda: list(items), none, f"list/{items}"),
    ]


def _arithmetic(rng: random.Random) -> list[Spec]:
    k, a, b = rng.randint(1, 20), rng.randint(2, 9), rng.randint(1, 20)
    d = rng.randint(2, 9)
    return [
        _x("add", f"returns x plus {k}", lambda x: x + k, f"plus/{k}", f"x+{k}"),
        _x("subtract", f"returns x minus {k}", lambda x: x - k, f"minus/{k}", f"x-{k}"),
        _x("multiply", f"returns x times {a}", lambda x: x * a, f"times/{a}", f"x*{a}"),
        _x("scale", f"returns {a} times x plus {b}", lambda x: a * x + b, f"affine/{a}/{b}", f"{a}*x+{b}"),
        _x("square", f"returns x squared plus {k}", lambda x: x * x + k, f"square/{k}", f"x*x+{k}"),
        _x("divide", f"returns x divided by {d}, rounded down", lambda x: x // d, f"floordiv/{d}", f"x//{d}", 0, 100),
        _x("remainder", f"returns the remainder of x divided by {d}", lambda x: x % d, f"mod/{d}", None, 0, 100),
        _xy("total", "returns the sum of x and y", lambda x, y: x + y, "add", "x+y"),
        _xy("product", "returns x times y", lambda x, y: x * y, "mul", "x*y"),
        _xy("combine", f"returns x plus y, times {a}", lambda x, y: (x + y) * a, f"sumtimes/{a}", f"(x+y)*{a}"),
        _xy("difference", f"returns x minus y minus {k}", lambda x, y: x - y - k, f"sub/{k}", f"x-y-{k}"),
        _xy("larger", "returns the larger of x and y", lambda x, y: max(x, y), "max", "max(x,y)"),
        _xy("distance", "returns the absolute difference between x and y", lambda x, y: abs(x - y), "absdiff", None),
        _xy("average", "returns the average of x and y, as a float", lambda x, y: (x + y) / 2, "mean", "(x+y)/2"),
    ]


def _strings(rng: random.Random) -> list[Spec]:
    k, n = rng.randint(2, 4), rng.randint(1, 3)
    suffix = rng.choice(["!", "?", "ing", "ed", "!!", "s"])
    c, old, new = rng.choice("aeiou"), rng.choice("aeo"), rng.choice("xyz*")
    prefix, sep = rng.choice("abcdgkmprt"), rng.choice(["-", "_", ", ", "+"])

    def s(name: str, says: str, solve: Callable[[str], Any], key: str, inputs: Callable = _word) -> Spec:
        return Spec(name, ("s",), says, solve, inputs, key)

    return [
        s("shout", "returns s in upper case", str.upper, "upper"),
        s("backwards", "returns s reversed", lambda t: t[::-1], "reverse"),
        s("initial", "returns the first character of s", lambda t: t[0], "first"),
        s("ending", f"returns the last {n} characters of s", lambda t: t[-n:], f"last/{n}"),
        s("size", "returns the number of characters in s", len, "len"),
        s("repeat", f"returns s repeated {k} times", lambda t: t * k, f"repeat/{k}"),
        s("decorate", f"returns s followed by '{suffix}'", lambda t: t + suffix, f"suffix/{suffix}"),
        s(
            "swap",
            f"returns s with every '{old}' replaced by '{new}'",
            lambda t: t.replace(old, new),
            f"rep/{old}/{new}",
        ),
        s("count", f"returns how many times the letter '{c}' appears in s", lambda t: t.count(c), f"count/{c}"),
        s(
            "starts",
            f"returns True if s starts with '{prefix}', else False",
            lambda t: t.startswith(prefix),
            f"pre/{prefix}",
        ),
        s("title", "returns s with its first letter in upper case and the rest in lower case", str.capitalize, "cap"),
        s(
            "vowels",
            "returns the number of vowels (a, e, i, o, u) in s",
            lambda t: sum(ch in "aeiou" for ch in t),
            "vow",
        ),
        s(
            "mirror",
            "returns True if s reads the same forwards and backwards, else False",
            lambda t: t == t[::-1],
            "pal",
        ),
        s("joined", f"returns the words of s joined by '{sep}'", lambda t: sep.join(t.split()), f"join/{sep}", _phrase),
        s("words", "returns the number of words in s", lambda t: len(t.split()), "nwords", _phrase),
        s("squash", "returns s without its spaces", lambda t: t.replace(" ", ""), "nospace", _phrase),
    ]


def _lists(rng: random.Random) -> list[Spec]:
    k, m = rng.randint(2, 5), rng.randint(0, 9)

    def xs(name: str, says: str, solve: Callable[[list], Any], key: str, inputs: Callable | None = None) -> Spec:
        return Spec(name, ("xs",), says, solve, inputs or _list(), key)

    nonempty = _list(min_len=1)
    return [
        xs("squares", "returns a list of the squares of the numbers in xs", lambda v: [x * x for x in v], "sq"),
        xs("evens", "returns a list of the even numbers in xs, in order", lambda v: [x for x in v if x % 2 == 0], "ev"),
        xs("scaled", f"returns a list of each number in xs times {k}", lambda v: [x * k for x in v], f"times/{k}"),
        xs("shifted", f"returns a list of each number in xs plus {m}", lambda v: [x + m for x in v], f"plus/{m}"),
        xs("total", "returns the sum of the numbers in xs", sum, "sum"),
        xs("biggest", "returns the largest number in xs (xs is not empty)", max, "max", nonempty),
        xs("above", f"returns how many numbers in xs are greater than {m}", lambda v: sum(x > m for x in v), f"gt/{m}"),
        xs("keep", f"returns a list of the numbers in xs that are greater than {m}",
           lambda v: [x for x in v if x > m], f"fgt/{m}"),
        xs("ordered", "returns xs sorted in increasing order", sorted, "sort"),
        xs("flipped", "returns xs in reverse order, as a list", lambda v: v[::-1], "rev"),
        xs("energy", "returns the sum of the squares of the numbers in xs", lambda v: sum(x * x for x in v), "sumsq"),
        xs("distinct", "returns the sorted list of the distinct numbers in xs", lambda v: sorted(set(v)), "uniq"),
        xs("product", "returns the product of the numbers in xs (1 for an empty list)", math.prod, "prod"),
        xs("head", "returns the first number of xs, or None if xs is empty", lambda v: v[0] if v else None, "first"),
        xs("negatives", "returns how many numbers in xs are negative", lambda v: sum(x < 0 for x in v), "neg"),
        Spec("lengths", ("words",), "returns a list of the lengths of the strings in words",
             lambda v: [len(w) for w in v], lambda r: (r.sample(WORDS, r.randint(0, 4)),), "lens"),
    ]  # fmt: skip


def _fizz(n: int, a: int, b: int) -> str:
    return (
        "FizzBuzz" if n % (a * b // math.gcd(a, b)) == 0 else "Fizz" if n % a == 0 else "Buzz" if n % b == 0 else str(n)
    )


def _fib(n: int, a: int, b: int) -> int:
    for _ in range(n):
        a, b = b, a + b
    return a


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


def _maybe_sorted(rng: random.Random) -> tuple:
    (v,) = _list()(rng)
    return (sorted(v) if rng.random() < 0.5 else v,)


def _algorithms(rng: random.Random) -> list[Spec]:
    a, b, k = rng.randint(2, 5), rng.randint(3, 7), rng.randint(2, 9)
    f0, f1 = rng.randint(0, 3), rng.randint(1, 3)
    n_small, n_mid = _ints(0, 10), _ints(1, 60)

    def sec(v: list) -> int:
        return sorted(set(v))[-2]

    return [
        Spec("factorial", ("n",), "returns the factorial of n (n >= 0)", math.factorial, n_small, "fact"),
        Spec("sequence", ("n",), f"returns number n (counting from 0) of the sequence that starts {f0}, {f1} and in "
             "which each later number is the sum of the two before it", lambda n: _fib(n, f0, f1), n_small,
             f"fib/{f0}/{f1}"),
        Spec("is_prime", ("n",), "returns True if n is a prime number, else False", lambda n: n > 1 and all(
            n % d for d in range(2, math.isqrt(n) + 1)), _ints(0, 60), "prime"),
        Spec("gcd", ("a", "b"), "returns the greatest common divisor of the positive integers a and b", math.gcd,
             _ints(1, 60, 2), "gcd"),
        Spec("digit_sum", ("n",), "returns the sum of the decimal digits of n (n >= 0)",
             lambda n: sum(map(int, str(n))), _ints(0, 99999), "digits"),
        Spec("multiples", ("n",), f"returns how many integers from 1 to n are divisible by {k}", lambda n: n // k,
             n_mid, f"div/{k}"),
        Spec("fizzbuzz", ("n",), f"returns 'FizzBuzz' if n is divisible by both {a} and {b}, 'Fizz' if only by {a}, "
             f"'Buzz' if only by {b}, else n as a string", lambda n: _fizz(n, a, b), n_mid, f"fizz/{a}/{b}"),
        Spec("reverse_words", ("s",), "returns s with the order of its words reversed, joined by single spaces",
             lambda s: " ".join(s.split()[::-1]), _phrase, "revwords"),
        Spec("second_largest", ("xs",), "returns the second largest distinct number in xs", sec,
             lambda r: (r.sample(range(-9, 30), r.randint(2, 7)),), "second"),
        Spec("running_sums", ("xs",), "returns the list of running sums of xs (element i is the sum of xs[0..i])",
             lambda v: list(itertools.accumulate(v)), _list(), "cumsum"),
        Spec("binary", ("n",), "returns the binary digits of n as a string, without a prefix (n >= 0)",
             lambda n: format(n, "b"), _ints(0, 200), "bin"),
        Spec("collatz", ("n",), "returns how many steps the Collatz process (halve n if even, else 3n + 1) takes "
             "to reach 1 from n (n >= 1)", _collatz, n_mid, "collatz"),
        Spec("is_sorted", ("xs",), "returns True if xs is in non-decreasing order, else False",
             lambda v: all(x <= y for x, y in itertools.pairwise(v)), _maybe_sorted, "sorted"),
        Spec("mode", ("xs",), "returns the most common number in xs, the smallest one on a tie (xs is not empty)",
             lambda v: min(Counter(v).items(), key=lambda kv: (-kv[1], kv[0]))[0], _list(0, 5, 1, 8), "mode"),
        Spec("reverse_digits", ("n",), "returns the integer whose decimal digits are those of n in reverse order "
             "(n >= 0)", lambda n: int(str(n)[::-1]), _ints(0, 9999), "revdig"),
        Spec("sum_multiples", ("n",), f"returns the sum of the positive integers below n that are multiples of {a} "
             f"or {b}", lambda n: sum(i for i in range(1, n) if i % a == 0 or i % b == 0), n_mid, f"summult/{a}/{b}"),
    ]  # fmt: skip


TEMPLATES: dict[str, Callable[[random.Random], list[Spec]]] = {
    "constant": _constants,
    "arithmetic": _arithmetic,
    "strings": _strings,
    "lists": _lists,
    "algorithms": _algorithms,
}


def check_families(families: tuple[str, ...], bare: bool = False) -> None:
    if not families or [f for f in families if f not in TEMPLATES]:
        raise ValueError(f"unknown code families {list(families)}; choose from {', '.join(FAMILIES)}")
    if bare and (other := [f for f in families if f not in BARE_FAMILIES]):
        raise ValueError(
            f"the code families {other} need quotes, brackets or newlines, which the tiny model's alphabet lacks "
            f"(its bare form writes one-line bodies such as 'x+3'): choose from {', '.join(BARE_FAMILIES)}, "
            "or use a chat model"
        )


def _cases(spec: Spec, rng: random.Random, count: int) -> list[tuple]:
    """``count`` distinct argument tuples, fewer when the input space is smaller."""
    seen: dict[str, tuple] = {}
    for _ in range(count * 20):
        args = spec.inputs(rng)
        seen.setdefault(repr(args), args)
        if len(seen) == count:
            break
    return list(seen.values())


def _test(spec: Spec, function: str, args: tuple) -> Case:
    expected = spec.solve(*copy.deepcopy(args))  # a solution must not see what another mutated
    return Case(f"{function}({', '.join(map(repr, args))})", repr(expected))


def generate(
    index: int,
    *,
    split: str = "train",
    families: tuple[str, ...] = FAMILIES,
    tests: int = 5,
    examples: int = 1,
    bare: bool = False,
    held_out_fraction: float = 0.1,
    seed: int = 0,
) -> CodeProblem:
    """Problem ``index`` of ``split`` (the test split takes the families in turn, so any prefix of
    it is balanced); ``bare``: only templates with a tiny-alphabet expression, named ``f``, no
    examples. A constant has one test and no example; a small input space, fewer tests."""
    check_families(families, bare)
    for attempt in range(100_000):
        rng = random.Random(f"code/{seed}/{split}/{','.join(families)}/{bare}/{index}/{attempt}")
        family = families[index % len(families)] if split == "test" else rng.choice(families)
        specs = [s for s in TEMPLATES[family](rng) if s.expression is not None or not bare]
        if not specs:
            continue
        spec = rng.choice(specs)
        if split_of(f"{family}/{spec.key}", held_out_fraction) != split:
            continue
        shown_count = 0 if bare or not spec.params else examples
        cases = _cases(spec, rng, shown_count + tests)
        shown, hidden = cases[:shown_count], cases[shown_count:] or cases
        function = "f" if bare else spec.function
        return CodeProblem(
            family=family,
            template=spec.function,
            function=function,
            params=spec.params,
            says=spec.says,
            tests=tuple(_test(spec, function, a) for a in hidden),
            examples=tuple(_test(spec, function, a) for a in shown),
            expression=spec.expression,
            split=split,
        )
    raise ValueError(f"no {split} problem in the code families {list(families)} (bare={bare})")
