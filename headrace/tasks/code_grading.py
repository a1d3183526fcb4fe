"""Grading a Python answer against hidden unit tests: find the code in the reply, check it
compiles and defines the function (in this process: no sandbox call for those), then run every
test of the answer in ONE sandbox call (``sandbox.run_tool``: a fresh ``python -I -S``, no
network, CPU/memory/wall limits), each test under its own CPU-time alarm so a loop in one test
fails that test and not the rest.

**Finding the code** (``extract_code``): the last fenced block (```python, ```py or bare ```)
that defines the function, else the last that compiles, else the first; a block cut off by
``max_tokens`` counts up to where it stops. Without a fence: from the first ``def``/``import``
line, the longest run of lines that compiles (prose after the code is dropped). The bare form
(``complete_body``) takes a stub such as ``def f(x): return`` and the longest prefix of the
reply that completes it into valid Python, as a completion model's stop sequences would.

**What counts**: a test passes when the value equals the expected literal with the same type
(``True`` is not ``1``, a subclass with a generous ``__eq__`` is not an ``int``; floats within
1e-6 relative, an int for a float is fine). The code runs at module level first; if that
raises, the tests still run on what it defined, and the error is reported. Answers may import
the standard library only (the sandbox's Python starts without site-packages). Not a defence
against a policy that attacks the harness (it runs in the same process), a defence against
accidents: loops, crashes, floods of output, ``exit()``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import secrets
import textwrap
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from headrace.tasks.code_problems import Case
from headrace.tasks.sandbox import Limits, run_tool

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = ("", "python", "py", "python3")
START = re.compile(r"^[ \t]*(?:async\s+def|def|import|from|class|@)\b", re.MULTILINE)
PER_TEST_CPU_S = 0.5
REMEMBERED = 4096  # graded answers kept per process
_GRADED: OrderedDict[tuple, Graded] = OrderedDict()
_IN_FLIGHT: dict[tuple, anyio.Event] = {}


def limits_for(tests: int, per_test_cpu_s: float = PER_TEST_CPU_S) -> Limits:
    """Room for every test to use its whole CPU allowance (and the module's run), with wall time
    for a loaded machine; the standard library only (``-S``: ~30 ms less start-up)."""
    cpu = per_test_cpu_s * (tests + 1) + 1.0
    return Limits(cpu_s=cpu, memory_mb=256, wall_s=2 * cpu + 2.0, output_bytes=65_536, site_packages=False)


# Runs in the sandbox. Names with a leading underscore and captured builtins keep the answer
# from changing the harness by accident; the candidate's stdout goes to a bounded sink.
_HARNESS = r"""
import os as _os, signal as _signal, sys as _sys
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
class _Sink:
    def __init__(self): self.n = 0
    def write(self, s): self.n += len(s); return len(s)
    def flush(self): pass
def _same(a, b, _type=type, _isinstance=isinstance, _len=len, _abs=abs, _zip=zip, _all=all):
    if _isinstance(b, float):
        return _type(a) in (int, float) and _abs(a - b) <= 1e-6 * max(1.0, _abs(b))
    if _type(a) is not _type(b):
        return False
    if _type(b) in (list, tuple):
        return _len(a) == _len(b) and _all(_same(x, y) for x, y in _zip(a, b))
    if _type(b) is dict:
        return a.keys() == b.keys() and _all(_same(a[k], b[k]) for k in b)
    return a == b
def _short(e, _type=type, _str=str):
    return (_type(e).__name__ + ": " + _str(e))[:300]
_signal.signal(_signal.SIGPROF, _alarm)
def _limit(seconds):
    _signal.setitimer(_signal.ITIMER_PROF, seconds)
_real_out = _sys.stdout
_sys.stdout = _sys.stderr = _Sink()
_ns = {"__name__": "__main__"}
_module_error = None
try:
    _limit(_PER_TEST)
    exec(compile(_CODE, "<answer>", "exec"), _ns)
except _Timeout:
    _module_error = "timeout"
except BaseException as _e:
    _module_error = _short(_e)
finally:
    _limit(0)
_results = []
for _call, _want in _TESTS:
    try:
        _limit(_PER_TEST)
        _got = eval(_call, _ns)
        _outcome = ("pass",) if _same(_got, eval(_want, {})) else ("fail", repr(_got)[:200])
        _limit(0)
    except _Timeout:
        _outcome = ("timeout",)
    except BaseException as _e:
        _limit(0)
        _outcome = ("error", _short(_e))
    _results.append(_outcome)
_os.write(1, (_MARK + repr((_module_error, _results)) + "\n").encode("utf-8", "replace"))
_os._exit(0)
"""


@dataclass(frozen=True)
class Graded:
    """``outcomes``: per test ``("pass",)``, ``("fail", repr_of_value)``, ``("error", message)``
    or ``("timeout",)``; empty when no test ran (no code, a syntax error, the sandbox killed)."""

    total: int
    outcomes: tuple[tuple[str, ...], ...] = ()
    no_code: bool = False
    syntax_error: str | None = None
    missing_function: bool = False
    module_error: str | None = None
    killed: str | None = None  # the sandbox's killed_reason, or "no result"
    seconds: float = 0.0  # the sandbox call, 0 when none was made
    cached: bool = False  # the same code on the same tests was graded before

    @property
    def passed(self) -> int:
        return sum(o[0] == "pass" for o in self.outcomes)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def timed_out(self) -> bool:
        return self.killed in ("wall", "cpu") or any(o[0] == "timeout" for o in self.outcomes)


def _compiles(code: str) -> bool:
    try:
        compile(code, "<answer>", "exec", dont_inherit=True)
    except Exception:  # noqa: BLE001 - SyntaxError, and ValueError/RecursionError/MemoryError on odd input
        return False
    return True


def defines(code: str, name: str) -> bool:
    """Whether module-level code binds ``name`` (a def, a class, an assignment, an import)."""
    try:
        tree = ast.parse(code)
    except Exception:  # noqa: BLE001 - as in _compiles
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def _longest_compiling_run(lines: list[str]) -> str | None:
    for end in range(len(lines), 0, -1):
        code = "\n".join(lines[:end])
        if _compiles(code):
            return code
    return None


def extract_code(text: str, function: str) -> str | None:
    """The Python code of a reply (see the module's docstring), or None when there is none."""
    blocks = [textwrap.dedent(m.group(2)) for m in FENCE.finditer(text) if m.group(1).lower() in PYTHON_TAGS]
    if blocks:
        for pick in (lambda b: defines(b, function), _compiles):
            chosen = [b for b in blocks if pick(b)]
            if chosen:
                return chosen[-1]
        return blocks[0]
    runs = []
    for start in START.finditer(text):
        lines = textwrap.dedent(text[start.start() :]).splitlines()
        runs.append(_longest_compiling_run(lines) or "\n".join(lines))
        if defines(runs[-1], function):
            return runs[-1]
    return next((r for r in runs if _compiles(r)), runs[0] if runs else None)


def complete_body(stub: str, reply: str) -> str:
    """``stub`` (``def f(x): return``) and the longest prefix of ``reply`` that makes it compile
    (the bare form: a completion model continues the stub; what follows its code is dropped)."""
    reply = reply.split("\n", 1)[0]
    for end in range(len(reply), 0, -1):
        if reply[:end].strip() and _compiles(stub + reply[:end]):
            return stub + reply[:end]
    return stub + reply


async def run_tests(
    code: str,
    function: str,
    tests: Sequence[Case],
    per_test_cpu_s: float = PER_TEST_CPU_S,
    limits: Limits | None = None,
) -> Graded:
    """Grade ``code`` (already extracted) on ``tests``: at most one sandbox call. The same code
    on the same tests is graded once per process (the members of a group often answer alike):
    a repeat waits for the call in flight or takes the remembered result (``cached``), except
    after a timeout or a kill, which the machine's load may have caused."""
    total = len(tests)
    if not _compiles(code):
        try:
            compile(code, "<answer>", "exec", dont_inherit=True)
            message = "does not compile"
        except SyntaxError as e:
            message = f"SyntaxError: {e.msg} (line {e.lineno})"
        except Exception as e:  # noqa: BLE001 - as in _compiles
            message = f"{type(e).__name__}: {e}"
        return Graded(total, syntax_error=message)
    if not defines(code, function):
        return Graded(total, missing_function=True)
    key = (code, tuple(tests), per_test_cpu_s)
    while (pending := _IN_FLIGHT.get(key)) is not None:
        await pending.wait()
    if (remembered := _GRADED.get(key)) is not None:
        _GRADED.move_to_end(key)
        return dataclasses.replace(remembered, seconds=0.0, cached=True)
    _IN_FLIGHT[key] = done = anyio.Event()
    try:
        graded = await _in_sandbox(code, tests, per_test_cpu_s, limits or limits_for(len(tests), per_test_cpu_s))
    finally:
        del _IN_FLIGHT[key]
        done.set()
    if graded.killed is None and not graded.timed_out:
        _GRADED[key] = graded
        while len(_GRADED) > REMEMBERED:
            _GRADED.popitem(last=False)
    return graded


async def _in_sandbox(code: str, tests: Sequence[Case], per_test_cpu_s: float, limits: Limits) -> Graded:
    mark = f"@@result-{secrets.token_hex(8)}@@"
    program = (
        f"_CODE = {code!r}\n_TESTS = {[(t.call, t.expected) for t in tests]!r}\n"
        f"_MARK = {mark!r}\n_PER_TEST = {per_test_cpu_s!r}\n{_HARNESS}"
    )
    started = anyio.current_time()
    result = await run_tool(program, limits)
    seconds = anyio.current_time() - started
    _, found, tail = result.stdout.partition(mark)
    if not found:
        return Graded(len(tests), killed=result.killed_reason or "no result", seconds=seconds)
    module_error, outcomes = ast.literal_eval(tail.strip().splitlines()[0])
    return Graded(len(tests), tuple(map(tuple, outcomes)), module_error=module_error, seconds=seconds)


def feedback(graded: Graded, tests: Sequence[Case], max_chars: int = 600) -> str:
    """What the model is shown after a failed attempt: what went wrong and which tests failed."""
    if graded.no_code:
        lines = ["No Python code was found in your answer."]
    elif graded.syntax_error:
        lines = [f"Your code does not compile: {graded.syntax_error}."]
    elif graded.missing_function:
        lines = ["Your code does not define the function that was asked for."]
    elif not graded.outcomes:
        lines = [f"Your code was stopped ({graded.killed}) before any test finished."]
    else:
        lines = [f"{graded.passed} of {graded.total} tests passed."]
        if graded.module_error:
            lines.append(f"Running your code raised {graded.module_error}.")
        for test, outcome in zip(tests, graded.outcomes, strict=False):
            if outcome[0] == "fail":
                lines.append(f"{test.call} returned {outcome[1]}, expected {test.expected}.")
            elif outcome[0] == "error":
                lines.append(f"{test.call} raised {outcome[1]}.")
            elif outcome[0] == "timeout":
                lines.append(f"{test.call} did not finish in time.")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max_chars - 4] + " ..."
