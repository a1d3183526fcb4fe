"""Generated multi-step word problems with exact integer answers.

``generate(index, seed=, difficulty=, split=)`` is a pure function of its arguments. A problem
belongs to the held-out ``"test"`` split when the hash of its question text falls in the
held-out fraction, so the two splits never share a question, whatever the seeds; each split
draws candidates until one lands in it (about 1/fraction draws for the test split).

``difficulty`` is a level 1-5 (``LEVELS``) or a ``Difficulty(steps, max_value)``: roughly the
number of arithmetic operations in the solution, and the largest number drawn for the statement
(a total it states, such as a trip's length or the bill paid, can be larger). ``difficulty_of``
builds one from a level with either part replaced.
Subtractions never go below zero and divisions are always exact. The reference solution shows
one operation a line and ends with ``#### N``, as GSM8K's do.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Difficulty:
    steps: int
    max_value: int

    def __post_init__(self) -> None:
        if self.steps < 1 or self.max_value < 10:
            raise ValueError(f"word_math difficulty needs steps >= 1 and max_value >= 10 (got {self})")


LEVELS = {
    1: Difficulty(2, 20),
    2: Difficulty(3, 50),
    3: Difficulty(4, 100),
    4: Difficulty(6, 500),
    5: Difficulty(8, 1000),
}


@dataclass(frozen=True)
class WordProblem:
    question: str
    answer: int
    solution: str  # one operation a line, then "#### <answer>"
    template: str
    steps: int  # operations in the solution
    split: str


_NAMES = [
    "Ava",
    "Ben",
    "Carla",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
]
_ITEMS = ["apples", "marbles", "stickers", "pencils", "books", "cards", "shells", "stamps", "coins", "beads"]
_GOODS = [
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("mug", "mugs"),
    ("shirt", "shirts"),
    ("lamp", "lamps"),
    ("ticket", "tickets"),
    ("plant", "plants"),
    ("puzzle", "puzzles"),
    ("scarf", "scarves"),
    ("cake", "cakes"),
]
_VEHICLES = ["car", "train", "bus", "cyclist", "boat", "truck"]
_PRODUCTS = ["toys", "bottles", "chairs", "bricks", "cans", "lamps", "shoes"]


class _Story:
    """The statement, the worked solution and the operation count of one problem as it is built."""

    def __init__(self, rng: random.Random, difficulty: Difficulty):
        self.rng, self.d = rng, difficulty
        self.text: list[str] = []
        self.work: list[str] = []
        self.ops = 0
        # multipliers and divisors grow with the level: 4 at max_value 20, 10 at 100, 32 at 1000
        self.factor = max(3, round(math.sqrt(difficulty.max_value)))

    def num(self, lo: int = 2, hi: int | None = None) -> int:
        return self.rng.randint(lo, max(lo, hi if hi is not None else self.d.max_value))

    def name(self, *avoid: str) -> str:
        return self.rng.choice([n for n in _NAMES if n not in avoid])

    def say(self, sentence: str) -> None:
        self.text.append(sentence)

    def calc(self, why: str, a: int, op: str, b: int) -> int:
        result = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
        assert result >= 0 and (op != "/" or a % b == 0), (a, op, b)
        self.work.append(f"{why}: {a} {op.replace('*', 'x')} {b} = {result}.")
        self.ops += 1
        return result

    def divisor(self, value: int) -> int | None:
        """A divisor of ``value`` in [2, factor], or None."""
        choices = [k for k in range(2, self.factor + 1) if value % k == 0]
        return self.rng.choice(choices) if choices else None


def _inventory(s: _Story) -> tuple[str, int]:
    who, items = s.name(), s.rng.choice(_ITEMS)
    have = s.num(s.d.max_value // 4 + 2)
    s.say(f"{who} has {have} {items}.")
    while s.ops < s.d.steps:
        move = s.rng.choice(["buy", "give", "packs", "split"] if have > 2 else ["buy", "packs"])
        if move == "buy":
            n = s.num()
            s.say(f"Then {who} {s.rng.choice(['buys', 'finds', 'is given'])} {n} more.")
            have = s.calc(f"{who} gets {n} more", have, "+", n)
        elif move == "give":
            friend, n = s.name(who), s.num(1, have - 1)
            s.say(f"{who} gives {n} to {friend}.")
            have = s.calc(f"{who} gives away {n}", have, "-", n)
        elif move == "packs" and s.ops + 2 <= s.d.steps:
            packs, each = s.num(2, s.factor), s.num(2, s.factor)
            s.say(f"Then {who} buys {packs} packs with {each} {items} in each pack.")
            bought = s.calc("The packs hold", packs, "*", each)
            have = s.calc(f"{who} now has", have, "+", bought)
        elif (k := s.divisor(have)) is not None:
            s.say(f"{who} splits them into {k} equal piles and keeps only one pile.")
            have = s.calc("One pile holds", have, "/", k)
    return f"How many {items} does {who} have now?", have


def _shopping(s: _Story) -> tuple[str, int]:
    who = s.name()
    goods = s.rng.sample(_GOODS, k=min(len(_GOODS), max(1, (s.d.steps + 1) // 2)))
    price_hi = max(5, s.d.max_value // 5)
    parts, total = [], 0
    for i, (_one, many) in enumerate(goods):
        qty, price = s.num(2, s.factor), s.num(2, price_hi)
        parts.append(f"{qty} {many} at ${price} each")
        cost = s.calc(f"The {many} cost", qty, "*", price)
        total = cost if i == 0 else s.calc("Running total", total, "+", cost)
        if s.ops >= s.d.steps:
            break
    s.say(f"{who} buys {', '.join(parts[:-1]) + ' and ' if len(parts) > 1 else ''}{parts[-1]}.")
    if s.ops < s.d.steps and total > 3:
        off = s.num(1, min(total - 1, max(2, total // 5)))
        s.say(f"A coupon takes ${off} off the bill.")
        total = s.calc("With the coupon", total, "-", off)
    if s.ops < s.d.steps:
        unit = s.rng.choice([u for u in (10, 20, 50, 100) if u <= max(10, total)])
        bill = (total // unit + 1) * unit
        s.say(f"{who} pays with ${bill}.")
        return "How many dollars of change does " + who + " get?", s.calc("The change is", bill, "-", total)
    return f"How many dollars does {who} spend?", total


def _travel(s: _Story) -> tuple[str, int]:
    vehicle, dist = s.rng.choice(_VEHICLES), 0
    legs = max(1, (s.d.steps + 1) // 2)
    for leg in range(legs):
        speed, hours = s.num(5, max(10, s.d.max_value // 2)), s.num(1, max(2, s.factor // 2))
        s.say(f"{'A' if leg == 0 else 'Then the'} {vehicle} travels at {speed} km per hour for {hours} hours.")
        part = s.calc(f"Leg {leg + 1} covers", speed, "*", hours)
        dist = part if leg == 0 else s.calc("So far", dist, "+", part)
        if s.ops >= s.d.steps:
            break
    if s.ops < s.d.steps:
        trip = dist + s.num(1, s.d.max_value)
        s.say(f"The whole trip is {trip} km long.")
        return "How many km are left to travel?", s.calc("Still to go", trip, "-", dist)
    return f"How many km does the {vehicle} travel in all?", dist


def _factory(s: _Story) -> tuple[str, int]:
    product = s.rng.choice(_PRODUCTS)
    machines, rate = s.num(2, s.factor), s.num(2, max(3, s.d.max_value // 4))
    s.say(f"A factory has {machines} machines, and each machine makes {rate} {product} an hour.")
    made = s.calc("Per hour the machines make", machines, "*", rate)
    if s.ops < s.d.steps:
        hours = s.num(2, s.factor)
        s.say(f"The machines run for {hours} hours.")
        made = s.calc("In all they make", made, "*", hours)
    good = ""
    if s.ops < s.d.steps and made > 2:
        good, bad = "good ", s.num(1, max(1, made // 4))
        s.say(f"{bad} of them fail inspection and are thrown away.")
        made = s.calc("Good ones", made, "-", bad)
    while s.ops < s.d.steps:
        extra = s.num(2, s.d.max_value)
        s.say(f"A second shift adds {extra} more {product}.")
        made = s.calc("With the second shift", made, "+", extra)
    return f"How many {good}{product} does the factory have?", made


def _baking(s: _Story) -> tuple[str, int]:
    who = s.name()
    batches, per = s.num(2, s.factor), s.num(4, max(6, s.d.max_value // 2))
    s.say(f"{who} bakes {batches} batches of cookies with {per} cookies in each batch.")
    cookies = s.calc("Cookies baked", batches, "*", per)
    while s.ops < s.d.steps - 2:
        extra = s.num(2, s.d.max_value)
        s.say(f"{s.name(who)} brings {extra} more cookies.")
        cookies = s.calc("Now there are", cookies, "+", extra)
    if s.ops >= s.d.steps:
        return f"How many cookies does {who} bake?", cookies
    friends = s.num(2, min(s.factor, cookies // 2))
    # eat enough that the rest shares out evenly (at least one cookie each), plus a few whole rounds
    eaten = cookies % friends + friends * s.rng.randint(0, min(3, cookies // friends - 1)) or friends
    s.say(f"{who} eats {eaten} of them and shares the rest equally among {friends} friends.")
    cookies = s.calc("Left to share", cookies, "-", eaten)
    if s.ops >= s.d.steps:
        return "How many cookies are left to share?", cookies
    return "How many cookies does each friend get?", s.calc("Each friend gets", cookies, "/", friends)


def _ages(s: _Story) -> tuple[str, int]:
    first = s.name()
    names, ages = [first], [s.num(2, max(12, s.d.max_value // 5))]
    s.say(f"{first} is {ages[0]} years old.")
    while s.ops < s.d.steps // 2 and len(names) < 5:
        who, base = s.name(*names), s.rng.randrange(len(names))
        kind = s.rng.choice(["older", "younger", "times"])
        if kind == "older":
            d = s.num(1, max(5, s.d.max_value // 10))
            s.say(f"{who} is {d} years older than {names[base]}.")
            age = s.calc(f"{who} is", ages[base], "+", d)
        elif kind == "younger" and ages[base] > 2:
            d = s.num(1, ages[base] - 1)
            s.say(f"{who} is {d} years younger than {names[base]}.")
            age = s.calc(f"{who} is", ages[base], "-", d)
        else:
            k = s.num(2, 4)
            s.say(f"{who} is {k} times as old as {names[base]}.")
            age = s.calc(f"{who} is", ages[base], "*", k)
        names.append(who)
        ages.append(age)
    if len(names) == 1 or s.ops >= s.d.steps:
        years = s.num(1, max(5, s.d.max_value // 10))
        return f"How old will {names[-1]} be in {years} years?", s.calc("Then", ages[-1], "+", years)
    total = ages[0]
    for age in ages[1:]:
        total = s.calc("Adding ages", total, "+", age)
    return f"What is the sum of the ages of {', '.join(names[:-1])} and {names[-1]}?", total


def _savings(s: _Story) -> tuple[str, int]:
    who = s.name()
    wage, weeks = s.num(5, max(10, s.d.max_value // 2)), s.num(2, s.factor)
    s.say(f"{who} earns ${wage} a week for {weeks} weeks.")
    money = s.calc("Earned", wage, "*", weeks)
    while s.ops < s.d.steps:
        move = s.rng.choice(["spend", "gift", "half"])
        if move == "spend" and money > 2:
            cost = s.num(1, money - 1)
            s.say(f"{who} spends ${cost} on a {s.rng.choice(_GOODS)[0]}.")
            money = s.calc("After that", money, "-", cost)
        elif move == "gift":
            gift = s.num(2, s.d.max_value)
            s.say(f"{s.name(who)} gives {who} ${gift}.")
            money = s.calc("With the gift", money, "+", gift)
        elif money % 2 == 0 and money > 0:
            s.say(f"{who} puts half of the money in a bank.")
            money = s.calc("Half stays with " + who, money, "/", 2)
    return f"How many dollars does {who} have left?", money


TEMPLATES: dict[str, Callable[[_Story], tuple[str, int]]] = {
    "inventory": _inventory,
    "shopping": _shopping,
    "travel": _travel,
    "factory": _factory,
    "baking": _baking,
    "ages": _ages,
    "savings": _savings,
}


def split_of(question: str, held_out_fraction: float = 0.1) -> str:
    """``"test"`` for the held-out share of question texts (by hash), else ``"train"``."""
    bucket = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    return "test" if bucket < held_out_fraction else "train"


def _level(difficulty: int | Difficulty) -> Difficulty:
    if isinstance(difficulty, Difficulty):
        return difficulty
    if difficulty not in LEVELS:
        raise ValueError(
            f"word_math difficulty must be a level in 1-{max(LEVELS)} or a Difficulty (got {difficulty!r})"
        )
    return LEVELS[difficulty]


def difficulty_of(level: int, steps: int = 0, max_value: int = 0) -> Difficulty:
    """``level`` with its operation count and largest number replaced where ``steps`` /
    ``max_value`` are set (0: the level's), e.g. ``difficulty_of(1, steps=1)`` for one-step
    problems with numbers up to 20, which small models can pass when level 1 is out of reach."""
    base = _level(level)
    try:
        return Difficulty(steps or base.steps, max_value or base.max_value)
    except ValueError:
        raise ValueError(
            f"word_math steps={steps} / max_value={max_value} are out of range: steps must be >= 1 and "
            f"max_value >= 10 (0 keeps level {level}'s {base.steps} steps / {base.max_value})"
        ) from None


def generate(
    index: int,
    *,
    seed: int = 0,
    difficulty: int | Difficulty = 2,
    split: str = "train",
    held_out_fraction: float = 0.1,
    templates: tuple[str, ...] | None = None,
) -> WordProblem:
    """Problem ``index`` of ``split``: the same arguments always give the same problem."""
    if split not in SPLITS:
        raise ValueError(f"word_math split must be one of {SPLITS} (got {split!r})")
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"word_math held_out_fraction must be in (0, 1) (got {held_out_fraction})")
    names = templates or tuple(TEMPLATES)
    if unknown := [t for t in names if t not in TEMPLATES]:
        raise ValueError(f"unknown word_math template(s) {unknown}; choose from {', '.join(TEMPLATES)}")
    level = _level(difficulty)
    for attempt in itertools.count():
        rng = random.Random(f"word_math/{seed}/{level.steps}/{level.max_value}/{split}/{index}/{attempt}")
        template = rng.choice(names)
        story = _Story(rng, level)
        question, answer = TEMPLATES[template](story)
        question = " ".join(story.text + [question])
        if split_of(question, held_out_fraction) == split:
            solution = "\n".join(story.work + [f"#### {answer}"])
            return WordProblem(question, answer, solution, template, story.ops, split)
    raise AssertionError("unreachable")
