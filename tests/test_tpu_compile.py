"""The TPU (Mosaic) ragged_paged_attention compiled for v5e and v6e without a TPU (libtpu's
topologies, tests/tpu_topology.py): XLA and Mosaic run for the chip (layouts, shape casts, VMEM
limits), nothing executes. Numerics are tests/test_tpu_kernels.py's (interpret mode).

The option matrix is covered, not multiplied out: CASES holds every value of every option, and
every pair that changes what Mosaic sees (KV dtype x head dim x path, KV dtype x page size,
q dtype x KV dtype; windows, soft-capping and attention sinks on both paths and every KV
dtype), checked by
`test_cases_cover_the_matrix`; each case compiles for both generations (one topology each).
Then, for SmolLM2-135M's shapes over a 4096-page pool: `compiled.memory_analysis()` (printed
with -s), and whether the pool in XLA's default TPU layout reaches the kernel without a per-call
copy (strict xfails for our kernels' head-major pool: head dim 64, int8 scales; passing for the
page-major pools: ours flat [N, B, 2 * Hkv * D], JAX's kernel's [N, B, 2 * Hkv', D], its cases
compiled under jax_kernel.compile_target). Skipped where libtpu is not installed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tpu import TpuBlockSizes, jax_kernel, ragged_paged_attention
from pallas_kernels.tpu import scale_rows
from pallas_kernels.tpu.attention import uses_decode_path
from tpu_topology import TOPOLOGIES, abstract, compile_for, tpu_device

BF16, F32, I8 = jnp.bfloat16, jnp.float32, jnp.int8
_NAMES = {BF16: "bf16", F32: "f32", I8: "int8"}

PAGES_PER_ROW = 8  # P: table width, so pages_per_block up to 4 is never clamped


@dataclasses.dataclass(frozen=True)
class Case:
    path: str  # "decode": T == S rows of one token; "prefill": T > S (ragged blocked kernel)
    q_dtype: object
    kv_dtype: object  # int8 pages come with f32 scales
    head_dim: int
    kv_heads: int
    group: int  # query heads per KV head
    page_size: int
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False  # attention sinks f32[Hq] (gpt-oss)
    pages_per_block: int = 2
    block_q: int = 16
    num_pages: int = 64  # N

    def __str__(self):
        extra = (f"-w{self.window}" if self.window else "") + (
            f"-cap{self.soft_cap:g}" if self.soft_cap else "") + ("-sinks" if self.sinks else "")
        return (f"{self.path}-q{_NAMES[self.q_dtype]}-kv{_NAMES[self.kv_dtype]}-d{self.head_dim}-"
                f"{self.kv_heads}x{self.group}-B{self.page_size}-ppb{self.pages_per_block}{extra}")

    def shapes(self):
        """(num_tokens T, num_rows S): T == S takes the decode path, T > S the prefill path."""
        return (8, 8) if self.path == "decode" else (48, 4)


CASES = [  # per KV dtype: every head dim on both paths; page sizes, GQA and options spread
    Case("decode", BF16, BF16, 64, 3, 3, 8, pages_per_block=4, sinks=True),
    Case("prefill", BF16, BF16, 64, 1, 8, 16, window=128, sinks=True),
    Case("decode", F32, BF16, 128, 8, 1, 32, soft_cap=30.0),
    Case("prefill", BF16, BF16, 128, 2, 4, 64, pages_per_block=1, block_q=32),
    Case("decode", BF16, BF16, 256, 1, 2, 16, window=100, soft_cap=50.0, pages_per_block=4),
    Case("prefill", F32, BF16, 256, 2, 2, 8, soft_cap=30.0, pages_per_block=4, block_q=8),
    Case("decode", F32, F32, 64, 2, 4, 32, window=64, pages_per_block=1, sinks=True),
    Case("prefill", F32, F32, 64, 3, 3, 8, block_q=32, sinks=True),
    Case("decode", BF16, F32, 128, 1, 1, 64),
    Case("prefill", F32, F32, 128, 8, 4, 16, window=100, soft_cap=30.0, pages_per_block=4),
    Case("decode", F32, F32, 256, 2, 8, 8, soft_cap=50.0, pages_per_block=3),
    Case("prefill", BF16, F32, 256, 1, 4, 32),
    Case("decode", BF16, I8, 64, 2, 4, 16, sinks=True),
    Case("prefill", F32, I8, 64, 3, 3, 32, window=100, soft_cap=30.0, sinks=True),
    Case("decode", F32, I8, 128, 1, 8, 8, window=64, pages_per_block=4),
    Case("prefill", BF16, I8, 128, 2, 2, 64, soft_cap=50.0, pages_per_block=1, block_q=32),
    Case("decode", BF16, I8, 256, 8, 1, 32, soft_cap=30.0),
    Case("prefill", F32, I8, 256, 1, 1, 8, window=128, pages_per_block=4, block_q=8),
]

OPTIONS = {  # every value each option must take somewhere in CASES
    "path": {"decode", "prefill"},
    "q_dtype": {BF16, F32},
    "kv_dtype": {BF16, F32, I8},
    "head_dim": {64, 128, 256},
    "kv_heads": {1, 2, 3, 8},
    "group": {1, 2, 3, 4, 8},
    "page_size": {8, 16, 32, 64},
    "pages_per_block": {1, 2, 3, 4},
    "block_q": {8, 16, 32},
}


def _pairs(cases, *fields):
    return {tuple(getattr(c, f) for f in fields) for c in cases}


def test_cases_cover_the_matrix():
    for name, values in OPTIONS.items():
        assert {getattr(c, name) for c in CASES} == values, name
    full = lambda *fields: set(itertools.product(*(OPTIONS[f] for f in fields)))
    assert _pairs(CASES, "kv_dtype", "head_dim", "path") == full("kv_dtype", "head_dim", "path")
    assert _pairs(CASES, "kv_dtype", "page_size") == full("kv_dtype", "page_size")
    assert _pairs(CASES, "q_dtype", "kv_dtype") == full("q_dtype", "kv_dtype")
    for option in ("window", "soft_cap"):
        with_option = [c for c in CASES if getattr(c, option) is not None]
        assert _pairs(with_option, "kv_dtype", "path") == full("kv_dtype", "path"), option
    assert any(c.window and c.soft_cap for c in CASES)
    with_sinks = [c for c in CASES if c.sinks]
    assert _pairs(with_sinks, "kv_dtype", "path") == full("kv_dtype", "path")


def abstract_inputs(case: Case, device) -> dict:
    """ragged_paged_attention's arrays as abstract values on `device` (head-major pool)."""
    num_tokens, num_rows = case.shapes()
    pool = (case.kv_heads, case.num_pages, case.page_size, case.head_dim)
    args = dict(
        q=abstract((num_tokens, case.kv_heads * case.group, case.head_dim), case.q_dtype, device),
        k_pages=abstract(pool, case.kv_dtype, device),
        v_pages=abstract(pool, case.kv_dtype, device),
        page_tables=abstract((num_rows, PAGES_PER_ROW), jnp.int32, device),
        seq_lens=abstract((num_rows,), jnp.int32, device),
        query_start=abstract((num_rows + 1,), jnp.int32, device),
    )
    if case.kv_dtype == I8:
        args["k_scale"] = args["v_scale"] = abstract(pool[:3], jnp.float32, device)
    if case.sinks:
        args["sinks"] = abstract((case.kv_heads * case.group,), jnp.float32, device)
    return args


def compile_case(case: Case, device):
    args = abstract_inputs(case, device)
    attend = functools.partial(
        ragged_paged_attention, sm_scale=case.head_dim ** -0.5, window=case.window,
        soft_cap=case.soft_cap, interpret=False,
        block_sizes=TpuBlockSizes(block_q=case.block_q, pages_per_block=case.pages_per_block))
    return compile_for(lambda a: attend(**a), args)


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def device(request):
    """One topology per generation for the whole module."""
    return tpu_device(request.param)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_compiles(device, case):
    num_tokens, num_rows = case.shapes()
    assert uses_decode_path(num_tokens, num_rows) == (case.path == "decode")
    compiled, seconds = compile_case(case, device)
    print(f"\n{device.device_kind} {case}: {seconds:.2f} s")
    out = compiled.out_info
    assert out.shape == (num_tokens, case.kv_heads * case.group, case.head_dim)
    assert out.dtype == case.q_dtype
    assert "tpu_custom_call" in compiled.as_text()


# SmolLM2-135M's attention (3 KV heads, 9 query heads, head dim 64) over a 65536-token pool.
MEMORY_CASE = dict(path="decode", q_dtype=BF16, head_dim=64, kv_heads=3, group=3, page_size=16,
                   pages_per_block=4, num_pages=4096)


@pytest.mark.parametrize("kv_dtype", [BF16, I8], ids=_NAMES.get)
def test_memory_analysis(device, kv_dtype):
    """Per-chip bytes of one compiled call (printed): arguments at least their logical size
    (tiled layouts may pad), the output at least bf16[T, Hq, D], nothing aliased."""
    case = Case(kv_dtype=kv_dtype, **MEMORY_CASE)
    compiled, _ = compile_case(case, device)
    stats = compiled.memory_analysis()
    print(f"\n{device.device_kind} {case} N={case.num_pages}: {stats}")
    logical = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                  for a in abstract_inputs(case, device).values())
    assert stats.argument_size_in_bytes >= logical
    out = compiled.out_info
    assert stats.output_size_in_bytes >= int(np.prod(out.shape)) * jnp.dtype(out.dtype).itemsize
    assert stats.alias_size_in_bytes == 0


def pool_copies(compiled, case: Case) -> int:
    """Copies (relayouts) of whole pool or scale arrays in the compiled module."""
    pool = f"{case.kv_heads},{case.num_pages},{case.page_size}"
    return len(re.findall(rf"= \w+\[{pool}[,\d]*\]\{{[^}}]*\}} copy\(", compiled.as_text()))


_RELAYOUT = ("XLA's default TPU layout of {} puts N minor (no lane padding) while the kernel takes "
             "its pool operands row-major: every call relayouts them")


@pytest.mark.parametrize("kv_dtype,head_dim", [
    pytest.param(BF16, 64, marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason=_RELAYOUT.format("bf16[Hkv, N, B, 64]"))),
    pytest.param(I8, 128, marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason=_RELAYOUT.format("the scales f32[Hkv, N, B]"))),
], ids=lambda v: _NAMES.get(v, str(v)))
def test_head_major_pool_is_copied_per_call(device, kv_dtype, head_dim):
    """Our kernels' head-major pool: strict xfails while XLA relayouts it per call. XLA keeps a
    TPU array row-major only when its minor dim is whole 128-lane tiles (compiled for v6e:
    [N, B, 8, 64] and [N, B, 6, 64] are relayouted too, [N, B, 384] and [N, B, 512] are not), so
    float pages of head dim 64 are served from the flat page-major pool [N, B, 2 * Hkv * D]
    (test_flat_page_major_pool_is_not_copied_per_call), and int8 pages too, with their scales
    as lane-dense rows per page (scale_rows.py); the head-major int8 pool serves the other head
    dims, and its scales f32[Hkv, N, B] are still relayouted."""
    case = Case(kv_dtype=kv_dtype, **dict(MEMORY_CASE, head_dim=head_dim))
    compiled, _ = compile_case(case, device)
    assert pool_copies(compiled, case) == 0


# Our kernels over the flat page-major pool f[N, B, 2 * Hkv * D] (float and int8 pages; head
# dims 64 to 256, both paths, windows, soft caps, sinks, GQA with 3 KV heads, page sizes 8 to
# 128: scale rows of one, several or part of a 128-lane tile per head).
FLAT_CASES = [
    Case("decode", BF16, BF16, 64, 3, 3, 16, pages_per_block=4),
    Case("prefill", F32, BF16, 64, 3, 3, 8, window=100, soft_cap=30.0, sinks=True),
    Case("decode", F32, F32, 128, 2, 4, 32, window=64, soft_cap=50.0, sinks=True),
    Case("prefill", BF16, F32, 256, 1, 8, 16, pages_per_block=1),
    Case("decode", BF16, I8, 64, 3, 3, 16, window=100, sinks=True),  # int8: + scale rows
    Case("prefill", F32, I8, 128, 2, 4, 8, soft_cap=30.0, pages_per_block=3),
    Case("decode", F32, I8, 256, 1, 2, 128, pages_per_block=1),
]


def compile_flat_case(case: Case, device):
    args = abstract_inputs(case, device)
    args["k_pages"] = abstract((case.num_pages, case.page_size,
                                2 * case.kv_heads * case.head_dim), case.kv_dtype, device)
    args["v_pages"] = None
    if case.kv_dtype == I8:  # the scales as rows f32[N, L] (scale_rows.py)
        del args["k_scale"], args["v_scale"]
        args["kv_scales"] = abstract(
            (case.num_pages, scale_rows.row_lanes(case.kv_heads, case.page_size)), F32, device)
    attend = functools.partial(
        ragged_paged_attention, sm_scale=case.head_dim ** -0.5, window=case.window,
        soft_cap=case.soft_cap, interpret=False,
        block_sizes=TpuBlockSizes(block_q=case.block_q, pages_per_block=case.pages_per_block))
    return compile_for(lambda a: attend(**a), args)


@pytest.mark.parametrize("case", FLAT_CASES, ids=str)
def test_flat_page_major_compiles(device, case):
    compiled, seconds = compile_flat_case(case, device)
    print(f"\n{device.device_kind} flat {case}: {seconds:.2f} s")
    assert compiled.out_info.shape == (*case.shapes()[:1], case.kv_heads * case.group,
                                       case.head_dim)
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("kv_dtype", [BF16, I8], ids=_NAMES.get)
def test_flat_page_major_pool_is_not_copied_per_call(device, kv_dtype):
    """SmolLM2's shapes (head dim 64, 3 KV heads) over 4096 pages in the flat page-major pool:
    [4096, 16, 384] is lane-dense, so XLA keeps it row-major and the kernel reads it in place
    (the head-major pool of the same bytes is relayouted per call, above); so are int8 pages'
    scale rows f32[4096, 128], where the head-major f32[3, 4096, 16] were relayouted."""
    case = Case(kv_dtype=kv_dtype, **MEMORY_CASE)
    compiled, _ = compile_flat_case(case, device)
    text, stats = compiled.as_text(), compiled.memory_analysis()
    print(f"\n{device.device_kind} flat {_NAMES[kv_dtype]}[4096, 16, 384]: {stats}")
    assert "[4096,16,384]" in text
    assert not re.search(r"\[4096,16,384\]\{[^}]*\} copy\(", text)
    assert not re.search(r"\[4096,128\]\{[^}]*\} copy\(", text)
    assert stats.argument_size_in_bytes >= 4096 * 16 * 384 * jnp.dtype(kv_dtype).itemsize


# JAX's kernel over the page-major pool: every value of every option it takes, over both paths
# (T == S decode steps, T > S mixed ones), 3 KV heads among them (padded to 4).
JAX_CASES = [  # (path, q dtype, KV dtype, head dim, KV heads, group, page size, window, soft cap)
    ("decode", BF16, BF16, 128, 3, 3, 16, None, None),
    ("prefill", F32, BF16, 256, 1, 8, 64, 128, 30.0),
    ("decode", F32, F32, 128, 8, 2, 8, 64, None),
    ("prefill", BF16, F32, 128, 2, 4, 32, None, 50.0),
    ("prefill", BF16, BF16, 128, 4, 2, 16, None, None),
]


def test_gemma2_heads_of_dim_256_take_our_kernel(device):
    """Gemma 2's 8 query heads, 4 KV heads of dim 256, bf16: JAX's kernel puts the 4 KV heads in
    one block, which Mosaic refuses ("The last dim size is not 128 in original base memref"), so
    it does not apply; ours over the flat pool compile, windows and soft caps included."""
    assert not jax_kernel.applies(256, BF16, num_q_heads=8, num_kv_heads=4, q_dtype=BF16)
    assert jax_kernel.applies(256, BF16, num_q_heads=8, num_kv_heads=1, q_dtype=BF16)
    for path in ("decode", "prefill"):
        case = Case(path, BF16, BF16, 256, 4, 2, 16, window=4096, soft_cap=50.0)
        compiled, _ = compile_flat_case(case, device)
        assert "tpu_custom_call" in compiled.as_text()


def test_jax_cases_cover_its_options():
    cols = list(zip(*JAX_CASES))
    assert all(jax_kernel.applies(c[3], c[2], num_q_heads=c[4] * c[5], num_kv_heads=c[4],
                                  q_dtype=c[1]) for c in JAX_CASES)
    assert set(cols[0]) == {"decode", "prefill"} and set(cols[1]) == {BF16, F32}
    assert set(cols[2]) == {BF16, F32} and set(cols[3]) == {128, 256}
    assert {1, 2, 3, 8} <= set(cols[4]) and set(cols[6]) == {8, 16, 32, 64}
    assert any(w for w in cols[7]) and any(c for c in cols[8])


def compile_jax_case(case, device, num_pages: int = 64):
    path, q_dtype, kv_dtype, head_dim, kv_heads, group, page_size, window, soft_cap = case
    num_tokens, num_rows = (8, 8) if path == "decode" else (48, 4)
    heads = jax_kernel.padded_kv_heads(kv_heads, kv_dtype)
    args = dict(
        q=abstract((num_tokens, kv_heads * group, head_dim), q_dtype, device),
        kv_pages=abstract((num_pages, page_size, 2 * heads, head_dim), kv_dtype, device),
        page_tables=abstract((num_rows, PAGES_PER_ROW), jnp.int32, device),
        seq_lens=abstract((num_rows,), jnp.int32, device),
        query_start=abstract((num_rows + 1,), jnp.int32, device))
    attend = functools.partial(jax_kernel.ragged_paged_attention, num_kv_heads=kv_heads,
                               sm_scale=head_dim ** -0.5, window=window, soft_cap=soft_cap)
    with jax_kernel.compile_target(device):
        compiled, seconds = compile_for(lambda a: attend(**a), args)
    return compiled, seconds, args


@pytest.mark.parametrize("case", JAX_CASES, ids=lambda c: "-".join(map(str, c[:2] + c[3:])))
def test_jax_kernel_compiles(device, case):
    compiled, seconds, args = compile_jax_case(case, device)
    print(f"\n{device.device_kind} JAX kernel {case}: {seconds:.2f} s")
    assert compiled.out_info.shape == args["q"].shape
    assert compiled.out_info.dtype == case[1]
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("kv_dtype", [BF16, F32], ids=_NAMES.get)
def test_page_major_pool_is_not_copied_per_call(device, kv_dtype):
    """JAX's kernel's page-major pool [N, B, 2 * Hkv', D] (D = 128: lanes full) reaches the
    kernel as XLA lays it out: no copy of the pool per call; its per-chip bytes printed."""
    case = ("decode", BF16, kv_dtype, 128, 8, 4, 16, None, None)
    compiled, _, args = compile_jax_case(case, device, num_pages=4096)
    text = compiled.as_text()
    copies = re.findall(r"= \w+\[4096,16,16,128\]\{[^}]*\} copy\(", text)
    stats = compiled.memory_analysis()
    print(f"\n{device.device_kind} page-major {_NAMES[kv_dtype]}[4096, 16, 16, 128]: {stats}")
    assert "[4096,16,16,128]" in text and copies == []
    assert stats.argument_size_in_bytes >= 4096 * 16 * 16 * 128 * jnp.dtype(kv_dtype).itemsize
