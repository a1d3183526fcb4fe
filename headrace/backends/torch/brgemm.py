"""bfloat16 x bfloat16 products summed and written in float32 on the CPU's bfloat16 units,
through torch's batch-reduce GEMM micro-kernel (``at::native::cpublas::brgemm``, the kernel
ATen's CPU flash attention and inductor's CPU GEMM templates call).

Why: the LM head's float32 logits (``head.py``) are a bfloat16 product that must not be rounded
to bfloat16, and torch's Python surface has no such matmul on a CPU (``torch.mm(...,
out_dtype=)`` has no CPU kernel in torch 2.13). So the head multiplied float32 copies on the
bfloat16 units, which reads twice the bytes and converts every weight on the way: on SmolLM2's
head that is about twice the time of the same products from bfloat16 inputs
(benchmarks/RESULTS.md, "The head on the micro-kernel").

torch exports the kernel only as a C++ function; ctypes reaches it by its mangled name. The
name spells the parameter types, so a torch whose signature differs has no such symbol and this
path is off. The kernel raises a C++ exception where it cannot run (oneDNN disabled, a build
without oneDNN's micro-kernels, a CPU below AVX-512), and an exception through ctypes aborts
the process. So it is first tried once per machine and torch in a child process (this file run
as a script), its answer cached beside the peak probe's, and it is used only while oneDNN is
enabled.

The weight is repacked once per version into blocks of ``BLOCK`` columns in the VNNI layout the
kernel reads (each pair of consecutive ``K`` values side by side): a bfloat16 copy the size of
the weight. Each output element is one float32 sum over ``K`` in the kernel's order whatever the
number of rows, so the sampler's 64 rows and the learner's thousands give a row the same bits.
With several torch threads the column blocks are shared out among that many threads (the
caller and a pool's workers; ctypes lets go of the GIL for each call, and the kernel's state is
per thread), each block still one call, so the bits are the one thread's.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

# columns a call: at 64 rows on SmolLM2's head, 64 → 9.9 ms, 256 → 8.6, 512 → 8.8, all 49,152
# in one call 35.5 (the kernel's own blocking then reads the rows again for every column tile)
BLOCK = 256
# rows a call: a few hundred rows of x stay in the core's cache over all the column blocks
ROWS = 256

_BRGEMM = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"
_RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"
# what changes whether the kernel can run: oneDNN reads these to cap the instruction set it uses
_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


# one caller at a time: the caller's share and the pool's (each worker's kernel state, kept per
# thread between a call and its release, belongs to one share at a time)
_LOCK = threading.Lock()
# the workers beside the caller, by their count (one entry)
_POOL: dict[int, ThreadPoolExecutor] = {}


def _forked() -> None:
    """In a forked child: the parent's pool has no threads here (work sent to it would never
    run), and the lock may have been held by a parent's thread that does not exist here."""
    global _LOCK
    _LOCK = threading.Lock()
    _POOL.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`products` computes ``x @ weight.T`` here: bfloat16 on a CPU with bfloat16
    units, an even ``K``, oneDNN enabled, and the kernel tried on this machine."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and bool(torch.backends.mkldnn.enabled)
        and available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[N, K]`` bfloat16) as the kernel reads it: for each block of ``BLOCK`` rows
    of ``weight`` (the last may be narrower), its ``[K / 2, width, 2]`` VNNI layout, all blocks
    one after the other in one flat tensor."""
    n, k = weight.shape
    w = weight.detach()
    blocks = []
    for start in range(0, n, BLOCK):
        part = w[start : start + BLOCK]
        blocks.append(part.t().reshape(k // 2, 2, part.shape[0]).permute(0, 2, 1).reshape(-1))
    return torch.cat(blocks) if len(blocks) > 1 else blocks[0].contiguous()


def products(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Float32 ``x @ weight.T`` (``x`` ``[M, K]`` bfloat16) from :func:`pack`'s ``weight``
    (``n`` its rows)."""
    kernel = _kernel()
    assert kernel is not None
    run, release = kernel
    x = x.contiguous()
    m, k = x.shape
    if packed.numel() != n * k:
        raise ValueError(f"packed weight of {packed.numel()} values for {n} x {k}")
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    xp, wp, op = x.data_ptr(), packed.data_ptr(), out.data_ptr()

    def share(cols: range) -> None:
        # the kernel keeps per-thread state (its hardware context on AMX) until released
        try:
            for row in range(0, m, ROWS):
                rows = min(ROWS, m - row)
                a, c = xp + row * k * 2, op + row * n * 4
                for col in cols:
                    width = min(BLOCK, n - col)
                    run(rows, width, k, k, width, n, False, a, wp + col * k * 2, c + col * 4, True)
        finally:
            release(True)

    blocks = range(0, n, BLOCK)
    threads = min(torch.get_num_threads(), len(blocks))  # n > 0 here: one block at least
    per = -(-len(blocks) // threads)
    shares = [blocks[i : i + per] for i in range(0, len(blocks), per)]
    with _LOCK:
        if len(shares) == 1:
            share(shares[0])
            return out
        pool = _workers(len(shares) - 1)
        others = [pool.submit(share, cols) for cols in shares[1:]]
        try:
            share(shares[0])
        finally:
            for done in others:
                done.result()  # every share finished (or raised) before out is handed back
    return out


def _workers(count: int) -> ThreadPoolExecutor:
    """The pool of ``count`` workers beside the caller, made again when the count changes;
    called under ``_LOCK``."""
    if count not in _POOL:
        for old in _POOL.values():
            old.shutdown(wait=True)
        _POOL.clear()
        _POOL[count] = ThreadPoolExecutor(count, thread_name_prefix="headrace-brgemm")
    return _POOL[count]


@functools.cache
def _kernel() -> tuple[Any, Any] | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        run, release = getattr(lib, _BRGEMM), getattr(lib, _RELEASE)
    except (OSError, AttributeError):
        return None
    # (M, N, K, ld_a, ld_b, ld_c, add_C, A, B, C, is_vnni)
    run.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_bool] + [ctypes.c_void_p] * 3 + [ctypes.c_bool]
    run.restype = None
    release.argtypes = [ctypes.c_bool]
    release.restype = None
    return run, release


@functools.cache
def bf16_units() -> bool:
    """Whether oneDNN runs on bfloat16 instructions here (AVX512-BF16 or AMX). Where it has none
    it would multiply the head's float32 copies in float32: the same numbers at ~3x the two
    bfloat16 matmuls' cost (``head.py``)."""
    cpu: Any = torch.cpu
    units = cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    return bool(torch.backends.mkldnn.is_available() and units)


@functools.cache
def available() -> bool:
    """Whether the kernel runs on this machine with this torch: tried in a child process once,
    the answer cached per CPU, torch version and oneDNN instruction-set cap."""
    if not (bf16_units() and _kernel() is not None):
        return False
    from .flops import cache_path, device_name, remembered

    caps = ",".join(f"{v}={os.environ.get(v, '')}" for v in _ISA_VARIABLES)
    key = f"{device_name(torch.device('cpu'))} | torch {torch.__version__} | {caps}"
    return bool(remembered(cache_path().with_name("brgemm.json"), key, (bool,), _tried_in_a_child))


def _tried_in_a_child() -> bool:
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve())], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip().endswith("ok")


def _check() -> bool:
    """The kernel's products against float64 ones, with a narrower last block and more rows than
    one call takes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS + 3, 64, generator=gen).bfloat16()
    weight = torch.randn(BLOCK + 44, 64, generator=gen).bfloat16()
    got = products(x, pack(weight), weight.shape[0]).double()
    exact = x.double() @ weight.double().t()
    return bool((got - exact).abs().max().item() < 1e-4 * max(1.0, exact.abs().max().item()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("ok" if _kernel() is not None and _check() else "wrong")
