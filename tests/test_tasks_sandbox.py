"""The tool sandbox: it computes, it has no network (not even back through setns), CPU, wall and
memory limits end runaway code, output is bounded, and cancellation leaves no process behind."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import anyio
import pytest

from headrace.tasks import sandbox
from headrace.tasks.sandbox import Limits, SandboxUnavailable, run_tool

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux namespaces")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_calculation_and_a_calculator():
    result = await run_tool("import math\nprint(sum(i * i for i in range(10)), math.factorial(5))")
    assert (result.stdout, result.exit_code, result.killed_reason, result.ok) == ("285 120\n", 0, None, True)
    calc = await run_tool("2^10 + 1,000 / 4", tool="calculator")
    assert calc.stdout == "1274\n" and calc.ok
    refused = await run_tool("__import__('os').system('true')", tool="calculator")
    assert refused.exit_code == 1 and "not allowed in a calculator expression" in refused.stderr
    error = await run_tool("1/0")
    assert error.exit_code == 1 and error.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert "_sandbox_child" not in error.stderr  # the traceback shows the tool's frames only


@pytest.mark.timeout(30)
async def test_no_network_even_to_a_listening_port_on_the_host():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        connect = f"""
import ctypes, os, socket
try:  # a root process in a plain network namespace could setns() back to ours: not here
    fd = os.open(f"/proc/{{os.getppid()}}/ns/net", os.O_RDONLY)
    print("setns", ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000))
except OSError as e:
    print("no setns:", e.strerror)
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as e:
    print("FAILED:", e.strerror)
print(sorted(os.listdir("/proc/self/fd")))
"""
        isolated = await run_tool(connect)
        assert "FAILED: Network is unreachable" in isolated.stdout and "CONNECTED" not in isolated.stdout
        assert "setns 0" not in isolated.stdout
        assert isolated.stdout.splitlines()[-1] == "['0', '1', '2', '3']"  # 3: listdir's own; no status fd
        control = await run_tool(connect, Limits(network=True))  # the same code does reach it without the namespace
        assert "CONNECTED" in control.stdout, control


@pytest.mark.timeout(60)
async def test_cpu_wall_and_memory_limits():
    spin = await run_tool("while True: pass", Limits(cpu_s=1, wall_s=30))
    assert (spin.killed_reason, spin.timed_out) == ("cpu", True)
    sleep = await run_tool("import time\nprint('up', flush=True)\ntime.sleep(60)", Limits(wall_s=1))
    assert (sleep.killed_reason, sleep.timed_out, sleep.stdout) == ("wall", True, "up\n")
    hog = await run_tool("chunks = []\nwhile True: chunks.append(bytearray(2**24))", Limits(memory_mb=200))
    assert (hog.killed_reason, hog.timed_out) == ("memory", False) and hog.exit_code != 0
    big = await run_tool("x = bytearray(2**30)\nprint('allocated')", Limits(memory_mb=200))
    assert big.killed_reason == "memory" and "allocated" not in big.stdout


async def test_output_is_bounded():
    noisy = "import sys\nprint('x' * 100_000)\nsys.stderr.write('e' * 100_000)"
    result = await run_tool(noisy, Limits(output_bytes=1000))
    assert result.ok and result.stdout.startswith("x" * 1000) and "[... 99001 more bytes cut]" in result.stdout
    assert len(result.stderr) < 1100


@pytest.mark.timeout(30)
async def test_cancellation_kills_the_child_and_what_it_spawned(tmp_path):
    pids_file = tmp_path / "pids"
    code = f"""
import os, subprocess, time
child = subprocess.Popen(["sleep", "60"])
open({str(pids_file)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
time.sleep(60)
"""
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_tool, code, Limits(wall_s=60))
        with anyio.fail_after(15):
            while not (pids_file.exists() and pids_file.read_text()):
                await anyio.sleep(0.02)
        pids = [int(pid) for pid in pids_file.read_text().split()]
        assert all(_alive(pid) for pid in pids)
        tg.cancel_scope.cancel()
    with anyio.move_on_after(5):  # SIGKILL is delivered asynchronously: the grandchild may take a moment
        while any(_alive(pid) for pid in pids):
            await anyio.sleep(0.01)
    assert not any(_alive(pid) for pid in pids), pids


async def test_no_namespaces_means_a_refusal_not_a_networked_run(tmp_path, monkeypatch):
    fake_child = tmp_path / "child.py"
    fake_child.write_text(
        "import os, sys\n"
        "os.write(int(sys.argv[1]), b'unavailable: unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: "
        "[Errno 1] Operation not permitted')\n"
    )
    monkeypatch.setattr(sandbox, "_CHILD", str(fake_child))
    with pytest.raises(SandboxUnavailable, match="Operation not permitted.*network=True"):
        await run_tool("print(1)")


async def test_the_verdict_cannot_be_forged_by_the_tool():
    forge = """
import os
for fd in range(3, 64):
    try:
        os.write(fd, b"unavailable: fake")
    except OSError:
        pass
os.write(2, b"unavailable: fake")
os._exit(1)
"""
    result = await run_tool(forge)
    assert result.exit_code == 1 and result.stderr == "unavailable: fake"  # an ordinary failure, no refusal
    assert os.environ.get("HOME") != (await run_tool("import os; print(os.environ['HOME'])")).stdout.strip()
