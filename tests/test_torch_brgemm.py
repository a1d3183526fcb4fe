"""torch's bfloat16 micro-kernel for the float32-logits head (``brgemm.py``): float32 sums of the
bfloat16 products, a row's bits whatever the rows beside it, and taken only where it can run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from unittest.mock import patch

import pytest

torch = pytest.importorskip("torch")

from headrace.backends.torch import brgemm, head  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def needs_kernel() -> None:
    if not brgemm.available():
        pytest.skip("torch's bfloat16 micro-kernel does not run here (no bfloat16 units or no ukernel)")


def test_the_micro_kernel_sums_the_products_in_float32_and_a_rows_bits_do_not_depend_on_the_others(one_thread):
    needs_kernel()
    gen = torch.Generator().manual_seed(0)
    n = 2 * brgemm.BLOCK + 44  # a narrower last block
    weight = (torch.randn(n, 96, generator=gen) * 0.2).bfloat16()
    x = torch.randn(brgemm.ROWS + 5, 96, generator=gen).bfloat16()  # more rows than one call takes
    packed = brgemm.pack(weight)
    assert packed.numel() == weight.numel() and packed.dtype == torch.bfloat16
    every = brgemm.products(x, packed, n)
    exact = x.double() @ weight.double().t()
    # float32 arithmetic on the exact products; a bfloat16 output would be off by ~1e-2 here
    assert every.dtype == torch.float32 and (every.double() - exact).abs().max().item() < 2e-6 * 16
    rounded = (x @ weight.t()).double()
    assert (rounded - exact).abs().max().item() > 1e-3
    for rows in (1, 7, 64, brgemm.ROWS + 1):
        assert torch.equal(brgemm.products(x[:rows], packed, n), every[:rows])
    assert torch.equal(head.float32_logits(x, weight), every)  # the learner's head takes it
    with pytest.raises(ValueError, match="packed weight"):
        brgemm.products(x, packed, n - 1)


def test_the_micro_kernel_is_taken_only_with_onednn_on_bfloat16_and_an_even_k(one_thread):
    needs_kernel()
    x, weight = torch.ones(4, 64, dtype=torch.bfloat16), torch.ones(300, 64, dtype=torch.bfloat16)
    assert brgemm.usable(x, weight)
    assert not brgemm.usable(x.float(), weight.float())
    odd = torch.ones(300, 63, dtype=torch.bfloat16)
    assert not brgemm.usable(x[:, :63], odd)  # VNNI pairs K's values
    torch.backends.mkldnn.enabled = False  # the kernel would raise, and through ctypes abort
    try:
        assert not brgemm.usable(x, weight)
    finally:
        torch.backends.mkldnn.enabled = True
    torch.set_num_threads(2)
    assert brgemm.usable(x, weight)  # its blocks shared among the threads


def test_several_threads_share_the_column_blocks_and_give_the_one_threads_bits(one_thread):
    needs_kernel()
    gen = torch.Generator().manual_seed(1)
    n = 4 * brgemm.BLOCK + 44  # five blocks, the last narrower
    weight = (torch.randn(n, 64, generator=gen) * 0.2).bfloat16()
    x = torch.randn(brgemm.ROWS + 9, 64, generator=gen).bfloat16()
    packed = brgemm.pack(weight)
    alone = brgemm.products(x, packed, n)
    seen: set[str] = set()
    run, release = brgemm._kernel()

    def recording(*args):
        seen.add(threading.current_thread().name)
        run(*args)

    for threads, workers in ((2, 1), (3, 2), (8, 4)):  # never more shares than blocks
        torch.set_num_threads(threads)
        seen.clear()
        with patch.object(brgemm, "_kernel", lambda: (recording, release)):
            shared = brgemm.products(x, packed, n)
        assert torch.equal(shared, alone)
        # the caller took a share and the pool the others (a worker may take two in a row)
        assert "MainThread" in seen and len(seen) >= 2 and set(brgemm._POOL) == {workers}
    torch.set_num_threads(2)
    assert torch.equal(brgemm.products(x[:1], packed, n), alone[:1])


def test_whether_the_kernel_runs_is_tried_in_a_child_once_and_cached(tmp_path, monkeypatch):
    if not (brgemm._kernel() is not None and brgemm.bf16_units()):
        pytest.skip("no bfloat16 units or no kernel symbol: never tried")
    child = subprocess.run([sys.executable, brgemm.__file__], capture_output=True, text=True, timeout=100)
    assert child.returncode == 0, child.stderr
    runs = child.stdout.strip() == "ok"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tried = []
    real = brgemm._tried_in_a_child
    monkeypatch.setattr(brgemm, "_tried_in_a_child", lambda: tried.append(1) or real())
    assert brgemm.available.__wrapped__() is runs
    assert brgemm.available.__wrapped__() is runs and tried == [1]  # the second answer from the cache
    (cached,) = json.loads((tmp_path / "headrace" / "brgemm.json").read_text()).items()
    assert "torch " + torch.__version__ in cached[0] and cached[1] is runs


def test_a_forked_child_makes_its_own_workers_and_lock(one_thread):
    needs_kernel()
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    weight = torch.ones(3 * brgemm.BLOCK, 64, dtype=torch.bfloat16)
    packed, x = brgemm.pack(weight), torch.ones(2, 64, dtype=torch.bfloat16)
    torch.set_num_threads(2)
    brgemm.products(x, packed, weight.shape[0])  # the parent's pool made
    # the child's copies of the pool (no threads there) and of a lock held at the fork would
    # never let it finish: it must make its own
    with brgemm._LOCK:
        pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a child that hangs dies of it rather than outliving the test
        ok = False
        try:
            ok = bool((brgemm.products(x, packed, weight.shape[0]) == 64).all())
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child never finished its products")
    assert os.waitstatus_to_exitcode(done[1]) == 0
