"""The native few-row float32 linear (worker/kernels/gemv_f32.cc) against paddle.matmul, and the
2 MiB-page weight memory (worker/weight_memory.py) the model's weights live in.

Shapes cover both work splits (rows of W for narrow layers, columns for layers of 8192+ outputs),
K and N that are not multiples of 4 / 16 (the tail loops), 1-8 rows, and the SmolLM2 shapes.
"""
from __future__ import annotations

import envs

envs.apply_compute_thread_env(2)

import gc  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

from worker import weight_memory  # noqa: E402
from worker.kernels import build, gemv  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    if envs.FD_NATIVE_KERNELS == "0":
        pytest.skip("FD_NATIVE_KERNELS=0")
    if build._compiler() is None or not build.cpu_has(*gemv.REQUIRED_CPU_FLAGS):
        pytest.skip("no compiler or no AVX-512F: paddle.matmul runs (tests/test_kernels_build.py covers the fallback)")
    module = gemv.load()
    if module is None:
        pytest.fail(f"fd_gemv_f32 did not build: {build.last_build('fd_gemv_f32')}")
    return module


@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (1536, 576), (576, 3072), (576, 49184), (7, 5), (33, 17),
                                 (130, 8200), (3, 20000)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_matches_matmul(kernel, k, n, rows):
    rng = np.random.default_rng(k * 31 + n + rows)
    x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal((k, n)).astype(np.float32))
    got = gemv.small_linear(x, w)
    assert got is not None and tuple(got.shape) == (rows, n)
    expected = paddle.matmul(x, w).numpy()
    # float32 sums of up to 1536 products of unit normals, summed in another order than MKL's
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=2e-4 * np.sqrt(k))


def test_weights_in_page_memory_work_with_the_kernel(kernel):
    rng = np.random.default_rng(3)
    array = rng.standard_normal((576, 960)).astype(np.float32)
    w = weight_memory.weight_tensor(array)
    x = paddle.to_tensor(rng.standard_normal((1, 576)).astype(np.float32))
    np.testing.assert_allclose(gemv.small_linear(x, w).numpy(), x.numpy() @ array, rtol=1e-4, atol=1e-3)


def test_rows_beyond_the_limit_and_disabled_kernels_fall_back(kernel, monkeypatch):
    x = paddle.ones([9, 16])
    w = paddle.ones([16, 32])
    assert gemv.small_linear(x, w) is None  # 9 rows > MAX_ROWS
    assert gemv.small_linear(paddle.ones([3, 16]), w, max_rows=2) is None
    monkeypatch.setenv("FD_NATIVE_KERNELS", "0")
    assert gemv.small_linear(paddle.ones([1, 16]), w) is None


def test_bad_shapes_are_errors_not_crashes(kernel):
    with pytest.raises(Exception, match="disagree on K"):
        kernel.fd_f32_small_linear(paddle.ones([1, 16]), paddle.ones([15, 32]))
    with pytest.raises(Exception, match="serves 1 to 8 rows"):
        kernel.fd_f32_small_linear(paddle.ones([9, 16]), paddle.ones([16, 32]))


@pytest.mark.parametrize("shape,dtype", [((576, 960), np.float32), ((3,), np.float32), ((5, 7), np.int16),
                                         ((0, 4), np.float32)])
def test_weight_tensor_holds_the_values(shape, dtype):
    rng = np.random.default_rng(1)
    array = (rng.standard_normal(shape) * 100).astype(dtype)
    tensor = weight_memory.weight_tensor(array)
    assert tuple(tensor.shape) == shape
    np.testing.assert_array_equal(tensor.numpy(), array)


def test_weight_tensor_outlives_every_other_reference():
    """The tensor alone keeps its segment mapped: dropping the source and collecting garbage changes nothing."""
    arrays = [np.full((1000, 100), float(i), dtype=np.float32) for i in range(3)]
    tensors = [weight_memory.weight_tensor(a) for a in arrays]
    big = weight_memory.weight_tensor(np.full((9000, 4000), 7.0, dtype=np.float32))  # its own segment
    del arrays
    gc.collect()
    for i, tensor in enumerate(tensors):
        assert float(tensor.sum()) == i * 100_000
    assert float(big[8999, 3999]) == 7.0
    assert float((tensors[1] + 1).mean()) == 2.0


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text.split("[")[1].split("]")[0] if "[" in text else "none"


def _anon_huge_kb_of(address: int) -> int | None:
    """AnonHugePages of the mapping holding ``address`` in this process (None: not found)."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def test_weights_sit_in_huge_pages_where_the_kernel_allows():
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_thp_mode()!r} here")
    array = np.ones((4096, 1024), dtype=np.float32)  # 16 MiB: several whole 2 MiB pages
    tensor = weight_memory.weight_tensor(array)
    huge_kb = _anon_huge_kb_of(tensor.data_ptr())
    assert huge_kb is not None, "the tensor's memory is not in a mapping of this process"
    # The kernel may fall short of pages under memory pressure; most of 16 MiB in 2 MiB pages is the norm.
    assert huge_kb >= 8 * 1024, f"only {huge_kb} KiB of the weights' mapping in huge pages"
