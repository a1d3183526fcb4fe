"""torch's bfloat16 micro-kernel for the float32-logits head (``brgemm.py``): float32 sums of the
bfloat16 products, a row's bits whatever the rows beside it, and taken only where it can run."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_the_micro_kernel_is_taken_only_with_one_thread_onednn_on_and_bfloat16(one_thread):
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
    assert not brgemm.usable(x, weight)  # oneDNN's threaded matmul then (head.py)


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
