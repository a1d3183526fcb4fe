"""Run a tool call (Python code, or an expression for a calculator) in a limited subprocess.

``await run_tool(code, Limits(...))`` starts ``python -I`` in a new session and a fresh temporary
directory. The child cuts its own network (new user + network namespaces: no interface but a
loopback that is down, and no way back), then sets CPU-time, address-space and file-size limits
(``setrlimit``) before it runs the code. The parent enforces the wall-clock limit, keeps at most
``output_bytes`` of each stream, and kills the whole process group when the call ends, times out
or is cancelled, reaping the child before it returns or re-raises.

Where namespaces are unavailable the call refuses (``SandboxUnavailable``) instead of running
the code with network access; ``Limits(network=True)`` runs it anyway, knowingly.
Not a jail for hostile code: the tool can read and write what the engine's user can, and the
number of processes it may start is not limited (each has the CPU limit, and the group is killed).
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc

from headrace.core.errors import EnvError
from headrace.tasks._sandbox_child import EXIT_MEMORY, MEMORY_MARK

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
TOOLS = ("python", "calculator")


class SandboxUnavailable(EnvError, RuntimeError):
    pass


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 2.0  # CPU time; the kernel counts whole seconds, so it is rounded up
    memory_mb: int = 512  # address space: Python alone takes ~30 MB, numpy ~300 MB more
    wall_s: float = 5.0  # from spawn, Python's start-up (~20-40 ms) included
    output_bytes: int = 16_384  # kept per stream; the rest is read and dropped
    file_mb: int = 16  # largest file the tool may write
    network: bool = False  # True runs without the network namespace: the tool reaches the network
    site_packages: bool = True  # False: the standard library only, ~30 ms faster (the calculator's way)

    def __post_init__(self) -> None:
        if min(self.cpu_s, self.memory_mb, self.wall_s, self.output_bytes, self.file_mb) <= 0:
            raise ValueError(f"sandbox limits must all be positive (got {self})")


@dataclass(frozen=True)
class ToolResult:
    """``killed_reason``: None, or ``wall``, ``cpu``, ``memory``, ``file_size``, ``signal SIGxxx``."""

    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    timed_out: bool  # the wall-clock or CPU-time limit ended it
    killed_reason: str | None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


class _Capped:
    """One output stream, read to the end, at most ``limit`` bytes of it kept."""

    def __init__(self, limit: int):
        self.limit, self.data, self.dropped = limit, bytearray(), 0

    async def drain(self, stream: anyio.abc.ByteReceiveStream) -> None:
        async for chunk in stream:
            room = self.limit - len(self.data)
            self.data += chunk[:room]
            self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        return text + f"\n[... {self.dropped} more bytes cut]" if self.dropped else text


_CALCULATOR = r"""
import _ast as ast, math, operator, sys  # _ast: the node classes without ast.py's imports (~20 ms)
BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor,
             "ceil": math.ceil, "log": math.log, "exp": math.exp, "factorial": math.factorial}
CONSTANTS = {"pi": math.pi, "e": math.e}

def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in BIN:
        return BIN[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](ev(node.operand))
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in FUNCTIONS and not node.keywords:
        return FUNCTIONS[node.func.id](*map(ev, node.args))
    what = getattr(node, "id", None) or getattr(getattr(node, "func", None), "id", None) or type(node).__name__
    raise ValueError(f"{what!r} is not allowed in a calculator expression")

try:
    value = ev(compile(EXPRESSION, "<expression>", "eval", ast.PyCF_ONLY_AST).body)
except (ValueError, ArithmeticError, SyntaxError, TypeError) as e:
    sys.exit(f"error: {e}")
if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
    value = int(value)
print(value if isinstance(value, int) else format(value, ".12g"))
"""


def calculator_program(expression: str) -> str:
    """The Python program that evaluates ``expression``: numbers, ``+ - * / // % ** ^``,
    parentheses, ``sqrt abs round min max floor ceil log exp factorial``, ``pi`` and ``e``."""
    expression = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-")
    expression = re.sub(r"(?<=\d),(?=\d{3}\b)", "", expression)  # 1,000
    return f"EXPRESSION = {expression!r}\n{_CALCULATOR}"


def _child_env(home: str) -> dict[str, str]:
    env = {"PATH": os.defpath, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
    env |= {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return env


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session: this reaches what it spawned
    except (ProcessLookupError, PermissionError):
        pass


def _unavailable(problem: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"the tool sandbox cannot cut the network here ({problem}). It needs Linux user and network "
        "namespaces: allow them (sysctl user.max_user_namespaces > 0, or kernel.unprivileged_userns_clone=1; "
        "in a container, a seccomp/AppArmor profile that permits unshare), or, accepting that tool code "
        "then reaches the network, run with network=True in the sandbox limits."
    )


def _killed_reason(code: int | None, stderr: str, wall: bool, cpu_possible: bool) -> str | None:
    if wall:
        return "wall"
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu_possible):  # soft CPU limit, then hard
        return "cpu"
    if code == EXIT_MEMORY and MEMORY_MARK in stderr:
        return "memory"
    if code == -signal.SIGXFSZ:
        return "file_size"
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return None


async def run_tool(code: str, limits: Limits = Limits(), *, tool: str = "python") -> ToolResult:
    """Run ``code`` (a Python program, or an expression when ``tool="calculator"``) in the
    sandbox. Never blocks the event loop; cancelling it kills the child and its descendants."""
    if tool not in TOOLS:
        raise ValueError(f"unknown sandbox tool {tool!r}; use one of {', '.join(TOOLS)}")
    program = calculator_program(code) if tool == "calculator" else code
    config = [int(limits.network), math.ceil(limits.cpu_s), limits.memory_mb * 2**20, limits.file_mb * 2**20]
    flags = ["-I"] if limits.site_packages and tool == "python" else ["-I", "-S"]
    out, err = _Capped(limits.output_bytes), _Capped(limits.output_bytes)
    status_r, status_w = os.pipe()
    try:
        with tempfile.TemporaryDirectory(prefix="headrace-tool-", ignore_cleanup_errors=True) as home:
            started = anyio.current_time()
            try:
                process = await anyio.open_process(
                    [sys.executable, *flags, _CHILD, *map(str, [status_w, *config])],
                    cwd=home,
                    env=_child_env(home),
                    start_new_session=True,
                    pass_fds=(status_w,),
                )
            finally:
                os.close(status_w)
            # open_process pipes all three by default
            assert process.stdin is not None and process.stdout is not None and process.stderr is not None
            try:
                with anyio.move_on_after(limits.wall_s) as wall:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(out.drain, process.stdout)
                        tg.start_soon(err.drain, process.stderr)
                        try:
                            await process.stdin.send(program.encode(errors="replace"))
                            await process.stdin.aclose()
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            pass  # the child is gone already; its exit code says why
                    await process.wait()
            finally:
                with anyio.CancelScope(shield=True):
                    _kill_group(process.pid)
                    await process.aclose()
            elapsed = anyio.current_time() - started
        status = os.read(status_r, 4096).decode(errors="replace")  # every writer is gone: no wait
    finally:
        os.close(status_r)
    if status.startswith("unavailable: "):
        raise _unavailable(status.removeprefix("unavailable: "))
    reason = _killed_reason(process.returncode, err.text(), wall.cancelled_caught, elapsed >= limits.cpu_s)
    return ToolResult(out.text(), err.text(), process.returncode, reason in ("wall", "cpu"), reason)


async def check_sandbox(limits: Limits = Limits()) -> None:
    """Raise ``SandboxUnavailable`` now, at start-up, rather than at the first tool call."""
    await run_tool("pass", limits)
