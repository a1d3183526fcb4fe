"""What grading costs: one sandbox call per answer (all its hidden tests) against one call per
test, sequential and 8 at a time; and a Harbor episode's phases (setup, agent, verifier) on the
shipped examples. Prints one JSON line per measurement.

    python benchmarks/code_sandbox_cost.py [ANSWERS]
"""

import asyncio
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from headrace.tasks import code_grading
from headrace.tasks.code_grading import run_tests
from headrace.tasks.code_problems import BARE_FAMILIES, generate
from headrace.tasks.harbor import Workspace
from headrace.tasks.harbor_format import find_tasks

N = int(sys.argv[1]) if len(sys.argv) > 1 else 40
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "harbor_tasks"


def answers(n):
    out = []
    for i in range(n):
        p = generate(i, families=BARE_FAMILIES, bare=True, tests=5)
        out.append((f"def f({', '.join(p.params)}): return {p.expression}  # {i}", p.tests))
    return out


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def timed(coros, concurrency):
    limiter = asyncio.Semaphore(concurrency)
    seconds = []

    async def one(coro):
        async with limiter:
            started = time.perf_counter()
            await coro
            seconds.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one(c) for c in coros))
    return time.perf_counter() - started, seconds


async def main():
    pool = answers(N)
    for concurrency in (1, 8):
        code_grading._GRADED.clear()
        cpu = children_cpu()
        whole, each = await timed([run_tests(code, "f", tests) for code, tests in pool], concurrency)
        cpu = children_cpu() - cpu
        tests = sum(len(t) for _, t in pool)
        code_grading._GRADED.clear()
        cpu_split = children_cpu()
        per_test = [run_tests(code, "f", [t]) for code, ts in pool for t in ts]
        whole_split, _ = await timed(per_test, concurrency)
        cpu_split = children_cpu() - cpu_split
        print(json.dumps({
            "what": "code answers", "answers": N, "tests": tests, "concurrency": concurrency,
            "one_call_per_answer_ms": round(1000 * whole / N, 1),
            "median_call_ms": round(1000 * statistics.median(each), 1),
            "one_call_per_test_ms_per_answer": round(1000 * whole_split / N, 1),
            "ratio": round(whole_split / whole, 2),
            "cpu_ms_per_answer": round(1000 * cpu / N, 1),
            "cpu_ms_per_answer_one_call_per_test": round(1000 * cpu_split / N, 1),
        }), flush=True)  # fmt: skip
    for task in find_tasks(EXAMPLES):
        phases = []
        for _ in range(3):
            ws = Workspace(task)
            await ws.prepare()
            await ws.run_agent("true")
            await ws.verify()
            phases.append(ws.seconds)
            ws.close()
        print(json.dumps({
            "what": "harbor episode", "task": task.name,
            **{f"{p}_ms": round(1000 * statistics.median(s.get(p, 0.0) for s in phases), 1)
               for p in ("setup", "agent", "verifier")},
        }), flush=True)  # fmt: skip


asyncio.run(main())
