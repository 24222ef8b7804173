"""The C++ CPU kernels' paged attention against pure-jnp references (decode rows, ragged causal
prefill, GQA groups, padding tokens, odd head dims, out-of-range page ids; float32, bfloat16 and
int8 pages with per-token scales, NaN in unused slots); every instruction
set's branch of the sources compiling; the choice of the backend; the build cache. The matmuls
and argmax are in test_cpu_matmul.py."""

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends.cpu import kernels as cpu_kernels
from jaxserve.model.kv_cache import quantize_kv
from pallas_kernels.reference import ref_paged_decode_attention, ref_ragged_paged_attention

# Tests that run the kernels; the others (layouts, the build's compile checks, the backend's
# choice without them) run where this machine cannot build or run them.
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"kernel not built: {cpu_kernels.unavailable_reason()}")
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="resolves for a CPU")


def _pool(rng, hkv, n, b, d):
    return (jnp.asarray(rng.standard_normal((hkv, n, b, d)), jnp.float32),
            jnp.asarray(rng.standard_normal((hkv, n, b, d)), jnp.float32))


def _tables(rng, lens, n, b, width):
    """Distinct random pages (never page 0) for each row, zeros past its length."""
    pages = rng.permutation(np.arange(1, n))
    tables, used = np.zeros((len(lens), width), np.int32), 0
    for s, length in enumerate(lens):
        k = -(-length // b)
        tables[s, :k] = pages[used:used + k]
        used += k
    return jnp.asarray(tables)


def _as_dtype(k, v, tables, lens, dtype):
    """The pool (k, v f32[Hkv, N, B, D]) in `dtype`, with NaN (int8: NaN scales) in every slot
    no row's keys occupy -> (k, v, scales: {} or {"k_scale", "v_scale"} f32[Hkv, N, B])."""
    b = k.shape[2]
    used = np.zeros(k.shape[1:3], bool)  # [N, B]
    for s, length in enumerate(lens):
        j = np.arange(length)
        used[np.asarray(tables)[s, j // b], j % b] = True
    if dtype == "int8":
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        ks, vs = (jnp.where(used, s, jnp.nan) for s in (ks, vs))
        return k, v, {"k_scale": ks, "v_scale": vs}
    k, v = (jnp.where(used[..., None], x, jnp.nan).astype(dtype) for x in (k, v))
    return k, v, {}


DTYPES = ["float32", "bfloat16", "int8"]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,b", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 16),
                                        (6, 2, 40, 4)])
def test_decode_matches_reference(hq, hkv, d, b, dtype):
    rng = np.random.default_rng(0)
    lens = [1, 5, b, b + 1, 3 * b + 7, 0, 50]  # 0: a padding row
    n, width = 64, -(-max(lens) // b)
    k, v = _pool(rng, hkv, n, b, d)
    tables = _tables(rng, lens, n, b, width)
    k, v, scales = _as_dtype(k, v, tables, lens, dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    rows = jnp.where(seq_lens > 0, jnp.arange(len(lens)), len(lens)).astype(jnp.int32)
    got = cpu_kernels.paged_attention(q, k, v, tables, seq_lens, rows,
                                      jnp.maximum(seq_lens - 1, 0), sm_scale=d ** -0.5, **scales)
    want = ref_paged_decode_attention(q, k, v, tables, seq_lens, sm_scale=d ** -0.5, **scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[5].any()  # the padding row is zeros


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_reference_with_padding_tokens(dtype):
    """Chunks of several rows back to back (one continues a cached prefix), then padding."""
    rng = np.random.default_rng(1)
    hq, hkv, d, b = 9, 3, 64, 16
    kv_lens, q_lens = [40, 17, 70], [40, 9, 30]  # row 1 and 2 have cached keys before the chunk
    k, v = _pool(rng, hkv, 64, b, d)
    tables = _tables(rng, kv_lens, 64, b, 8)
    k, v, scales = _as_dtype(k, v, tables, kv_lens, dtype)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(query_start[-1]) + 5
    token_row = np.full(t, len(kv_lens), np.int32)
    positions = np.zeros(t, np.int32)
    for s, (kl, ql) in enumerate(zip(kv_lens, q_lens)):
        token_row[query_start[s]:query_start[s + 1]] = s
        positions[query_start[s]:query_start[s + 1]] = np.arange(kl - ql, kl)
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
    seq_lens = jnp.asarray(kv_lens, jnp.int32)
    got = cpu_kernels.paged_attention(q, k, v, tables, seq_lens, token_row, positions,
                                      sm_scale=0.125, **scales)
    want = ref_ragged_paged_attention(q, k, v, tables, seq_lens, jnp.asarray(query_start),
                                      sm_scale=0.125, **scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[-5:].any()


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,lens", [(9, 3, [300]), (9, 3, [250, 3]), (4, 1, [400, 0]),
                                         (8, 2, [17, 130])])
def test_few_rows_split_their_pages_and_match(hq, hkv, lens, dtype):
    """Too few (token, head) units for the threads: each unit's pages are split over them and
    the splits' softmax states merged (splits past a short row's pages are empty). int8 pages
    split too: 300 keys of 3 heads are over the 64 KB the split needs."""
    rng = np.random.default_rng(len(lens) + hkv)
    d, b = 64, 16
    k, v = _pool(rng, hkv, 64, b, d)
    tables = _tables(rng, lens, 64, b, 26)
    k, v, scales = _as_dtype(k, v, tables, lens, dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    rows = jnp.where(seq_lens > 0, jnp.arange(len(lens)), len(lens)).astype(jnp.int32)
    got = jax.jit(lambda q: cpu_kernels.paged_attention(
        q, k, v, tables, seq_lens, rows, jnp.maximum(seq_lens - 1, 0), sm_scale=0.125,
        **scales))(q)
    want = ref_paged_decode_attention(q, k, v, tables, seq_lens, sm_scale=0.125, **scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.isfinite(np.asarray(got)).all()


@needs_kernels
def test_int8_pages_are_read_in_place_and_match_the_dequantized_f32_pool():
    """The int8 call passes the pool and its scales to the kernel as they are (no converted
    copy: the jitted program has no convert of the pool), and equals the f32 kernel on the
    dequantized pool."""
    rng = np.random.default_rng(9)
    hq, hkv, d, b, lens = 9, 3, 64, 16, [70, 1, 33]
    k, v = _pool(rng, hkv, 64, b, d)
    tables = _tables(rng, lens, 64, b, 5)
    kq, vq, scales = _as_dtype(k, v, tables, lens, "int8")
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    attend = jax.jit(lambda k, v, scales: _attend(q, k, v, tables, lens, **scales))
    hlo = attend.lower(kq, vq, scales).as_text()
    assert "jaxserve_paged_attention_int8" in hlo
    assert not re.search(r"convert.*tensor<3x64x16x64xi8>", hlo)
    dequantized = {name: jnp.nan_to_num(x.astype(jnp.float32) * scales[f"{name}_scale"][..., None])
                   for name, x in (("k", kq), ("v", vq))}
    np.testing.assert_allclose(np.asarray(attend(kq, vq, scales)),
                               np.asarray(_attend(q, dequantized["k"], dequantized["v"], tables,
                                                  lens)), atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("k_dtype,v_dtype,scales,match", [
    ("float16", "float16", False, "float32, bfloat16 or int8"),
    ("int32", "int32", False, "float32, bfloat16 or int8"),
    ("float32", "bfloat16", False, "k float32, v bfloat16"),
    ("int8", "int8", False, "need k_scale and v_scale"),
    ("float32", "float32", True, "float pages take none"),
])
def test_unsupported_pools_are_a_value_error(k_dtype, v_dtype, scales, match):
    k = jnp.zeros((1, 4, 4, 8), k_dtype)
    v = jnp.zeros((1, 4, 4, 8), v_dtype)
    kw = {"k_scale": jnp.ones((1, 4, 4)), "v_scale": jnp.ones((1, 4, 4))} if scales else {}
    with pytest.raises(ValueError, match=match):
        _attend(jnp.zeros((1, 1, 8)), k, v, [[1]], [3], **kw)
    if k_dtype == "int8":  # scales of the wrong shape
        with pytest.raises(ValueError, match=r"want \(1, 4, 4\)"):
            _attend(jnp.zeros((1, 1, 8)), k, v, [[1]], [3], k_scale=jnp.ones((1, 4)),
                    v_scale=jnp.ones((1, 4, 4)))


@needs_kernels
def test_large_batch_uses_threads_and_matches():
    """Enough units to split over the thread pool; results must not depend on the split."""
    rng = np.random.default_rng(2)
    hq, hkv, d, b = 9, 3, 64, 16
    lens = rng.integers(1, 200, 96).tolist()
    k, v = _pool(rng, hkv, 1400, b, d)
    tables = _tables(rng, lens, 1400, b, 13)
    seq_lens = jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    f = jax.jit(lambda q: cpu_kernels.paged_attention(
        q, k, v, tables, seq_lens, jnp.arange(len(lens), dtype=jnp.int32), seq_lens - 1,
        sm_scale=0.125))
    want = ref_paged_decode_attention(q, k, v, tables, seq_lens, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(f(q)), np.asarray(want), atol=2e-5, rtol=2e-5)


@needs_kernels
def test_extreme_scores_stay_finite():
    """Large logits: the softmax subtracts the row max, so nothing overflows."""
    rng = np.random.default_rng(3)
    k, v = _pool(rng, 1, 8, 4, 16)
    tables = jnp.asarray([[1, 2, 3]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 1, 16)) * 1e3, jnp.float32)
    seq_lens = jnp.asarray([11], jnp.int32)
    got = cpu_kernels.paged_attention(q, k, v, tables, seq_lens, jnp.zeros(1, jnp.int32),
                                            seq_lens - 1, sm_scale=1.0)
    want = ref_paged_decode_attention(q, k, v, tables, seq_lens, sm_scale=1.0)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def _attend(q, k, v, tables, lens, sm_scale=0.125, **scales):
    """Decode rows: row s's token at position lens[s] - 1 (padding where lens[s] is 0)."""
    seq_lens = jnp.asarray(lens, jnp.int32)
    rows = jnp.where(seq_lens > 0, jnp.arange(len(lens)), len(lens)).astype(jnp.int32)
    return jax.block_until_ready(cpu_kernels.paged_attention(
        q, k, v, jnp.asarray(tables, jnp.int32), seq_lens, rows, jnp.maximum(seq_lens - 1, 0),
        sm_scale=sm_scale, **scales))


@needs_kernels
@pytest.mark.parametrize("bad", [-1, 64, 1 << 30])
@pytest.mark.parametrize("jit", [False, True])
def test_out_of_range_page_ids_are_an_error(bad, jit):
    """A page id outside the pool (N = 64 pages) among the pages a row's keys occupy fails the
    call with a message naming the row and the id, instead of reading outside the pool."""
    rng = np.random.default_rng(6)
    hq, hkv, d, b = 4, 2, 32, 8
    k, v = _pool(rng, hkv, 64, b, d)
    lens = [20, 9, 0]  # row 1's keys fill pages 0 and 1 of its table; row 2 is padding
    tables = np.array(_tables(rng, lens, 64, b, 4))
    tables[1, 1] = bad
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    attend = jax.jit(_attend) if jit else _attend
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=rf"row 1 reads page id {bad} .*outside the pool's 64 pages"):
        attend(q, k, v, tables, lens)


@needs_kernels
def test_page_ids_past_a_rows_keys_are_not_read():
    """Table entries past a row's seq_len, and a padding row's, may hold anything: they are
    neither checked nor read."""
    rng = np.random.default_rng(7)
    hq, hkv, d, b = 4, 2, 32, 8
    k, v = _pool(rng, hkv, 64, b, d)
    lens = [20, 9, 0]
    tables = np.array(_tables(rng, lens, 64, b, 4))
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    want = ref_paged_decode_attention(q, k, v, jnp.asarray(tables), jnp.asarray(lens, jnp.int32),
                                      sm_scale=0.125)
    tables[0, 3], tables[1, 2:], tables[2, :] = -5, 1 << 30, 64
    got = _attend(q, k, v, tables, lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[2].any()


@needs_kernels
def test_a_seq_len_past_the_page_table_is_an_error():
    """Row 1 claims 33 keys where its table holds 4 pages of 8."""
    rng = np.random.default_rng(8)
    k, v = _pool(rng, 1, 16, 8, 16)
    tables = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 1, 16)), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"row 1 has seq_len 33, more than its page table holds "
                             r"\(4 pages of 8 keys\)"):
        _attend(q, k, v, tables, [32, 33])


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_write_kv_equals_the_xla_scatter_in_place(dtype):
    """The backend's write (write_kv.cc) leaves the same pages and scales, bit for bit, as
    kv_cache.write_kv's scatter and quantization, over a pool of random pages (a zero vector
    and the scratch page included), without copying the donated pages; a slot outside the
    pool is an error."""
    from jaxserve.backends import cpu
    from jaxserve.model.kv_cache import KVPool, write_kv

    rng = np.random.default_rng(11)
    cache = KVPool.zeros(1, 3, 6, 4, 8, jnp.dtype(dtype)).layers[0]
    cache = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape) * 3).astype(a.dtype), cache)
    k = jnp.asarray(rng.standard_normal((7, 3, 8)), jnp.float32).at[2].set(0.0)
    v = jnp.asarray(rng.standard_normal((7, 3, 8)) * 100, jnp.float32)
    # Distinct slots: the order of XLA's writes to one slot is unspecified.
    slots = jnp.asarray([5, 9, 0, 23, 12, 1, 17], jnp.int32)
    want = jax.jit(write_kv)(cache, k, v, slots)
    got = jax.jit(cpu.write_kv)(cache, k, v, slots)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                      np.asarray(w.astype(jnp.float32)))
    donated = jax.jit(cpu.write_kv, donate_argnums=0).lower(cache, k, v, slots).compile()
    assert " copy(" not in donated.as_text()
    # INVALID_ARGUMENT: a ValueError where the call runs as it is dispatched
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                       match="token 3 writes slot 24, outside the pool's 24 slots"):
        jax.block_until_ready(jax.jit(cpu.write_kv)(cache, k, v, slots.at[3].set(24)))


@needs_kernels
@on_cpu
def test_backend_resolution():
    from jaxserve.backends import resolve

    # On CPU with float32 weights: the kernels where they have a vector path, for a pool of
    # float32, bfloat16 or int8 pages (the pages they read in place); bfloat16 weights are xla's.
    fast = "cpu" if cpu_kernels.has_vector_path() else "xla"
    assert resolve("auto") == fast
    for kv in ("bfloat16", "int8"):
        assert resolve("auto", kv_cache_dtype=kv) == fast
    assert resolve("auto", kv_cache_dtype="float16") == "xla"
    assert resolve("auto", "bfloat16") == "xla"
    with pytest.raises(ValueError, match="float32"):
        resolve("cpu", "bfloat16")


@on_cpu
def test_auto_is_xla_without_a_vector_path(monkeypatch):
    """The portable build is far slower than XLA's dot: "auto" does not pick it (nor builds the
    kernels to find out), while "cpu" may still be asked for."""
    from jaxserve.backends import resolve

    monkeypatch.setattr(cpu_kernels, "has_vector_path", lambda: False)
    monkeypatch.setattr(cpu_kernels, "available", lambda: pytest.fail("built the kernels"))
    assert resolve("auto") == "xla"
    assert resolve("auto", "bfloat16") == "xla"


@needs_kernels
@on_cpu
def test_auto_is_cpu_with_a_vector_path(monkeypatch):
    from jaxserve.backends import resolve

    monkeypatch.setattr(cpu_kernels, "has_vector_path", lambda: True)
    assert resolve("auto") == "cpu"
    assert resolve("auto", "float32", "int8") == "cpu"


@pytest.mark.parametrize("machine,flags,want", [
    ("x86_64", {"avx512f"}, True),
    ("x86_64", {"avx", "avx2", "fma", "sse4_2"}, True),
    ("AMD64", {"avx2", "fma"}, True),  # Windows' name for it
    ("x86_64", {"avx", "avx2"}, False),  # AVX2 without FMA: the matmul's portable branch
    ("x86_64", {"avx", "fma"}, False),
    ("x86_64", set(), False),  # no /proc/cpuinfo flags
    ("aarch64", {"avx512f", "avx2", "fma"}, False),  # only x86-64 has these branches
    ("arm64", set(), False),
])
def test_has_vector_path(monkeypatch, machine, flags, want):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(flags))
    assert cpu_kernels.has_vector_path() is want


# The instruction sets the sources have branches for: the flags that select each on any x86-64
# machine (whether or not it can run the result), the macros each must define to take its
# branch and those it must not.
ISAS = {
    "portable x86-64": (("-march=x86-64",), (),
                        ("__AVX2__", "__FMA__", "__AVX512F__", "__AMX_TILE__")),
    "AVX2+FMA": (("-march=haswell",), ("__AVX2__", "__FMA__"), ("__AVX512F__",)),
    "AVX-512": (("-march=skylake-avx512",), ("__AVX512F__",), ("__AVX512BF16__", "__AMX_TILE__")),
    "AMX-BF16": (("-march=sapphirerapids",),
                 ("__AVX512F__", "__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__"), ()),
}


def _x86_compiler() -> str | None:
    cxx = cpu_kernels.compiler()
    try:
        target = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True,
                                timeout=60, check=False).stdout if cxx else ""
    except OSError:
        return None
    return cxx if target.startswith("x86_64") else None


def _predefined(cxx: str, arch) -> dict[str, str]:
    """The macros the compiler predefines with the flags `arch`: name -> value."""
    out = subprocess.run([cxx, *arch, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                         text=True, check=True).stdout
    return {parts[1]: parts[2] if len(parts) > 2 else ""
            for parts in (line.split(None, 2) for line in out.splitlines()) if len(parts) > 1}


def _tested_macros(path) -> set[str]:
    """The names the #if, #ifdef and #elif lines of a source test."""
    names = set()
    for line in path.read_text().replace("\\\n", " ").splitlines():
        if m := re.match(r"\s*#\s*(?:if|ifdef|ifndef|elif)\b(.*)", line.split("//")[0]):
            names |= set(re.findall(r"[A-Za-z_]\w*", m.group(1))) - {"defined"}
    return names


@pytest.mark.skipif(_x86_compiler() is None, reason="no C++ compiler for x86-64")
def test_every_instruction_sets_branch_compiles():
    """Each source compiles (compile only: no machine runs them all) with the kernels' flags for
    each instruction set its #if branches choose between, wherever the tests run. A source's
    branches see only the macros it and its header test, so instruction sets that agree on
    those compile the same code: each choice is compiled once, and not at all where it is this
    CPU's and the library built (the same command, -march=native)."""
    cxx = _x86_compiler()
    defined = {}
    for isa, (arch, required, absent) in ISAS.items():
        defined[isa] = _predefined(cxx, arch)
        assert set(required) <= defined[isa].keys(), (isa, arch)
        assert not set(absent) & defined[isa].keys(), (isa, arch)
    native = _predefined(cxx, cpu_kernels.NATIVE) if cpu_kernels.available() else None
    header_macros = set().union(*map(_tested_macros, cpu_kernels.HEADERS))
    jobs = []
    for src in cpu_kernels.SOURCES:
        tested = _tested_macros(src) | header_macros
        # The branches an instruction set takes: the values it gives the macros the source tests.
        choices = {isa: frozenset((m, v) for m, v in defined[isa].items() if m in tested)
                   for isa in ISAS}
        built = {frozenset((m, v) for m, v in native.items() if m in tested)} if native else set()
        for isa, choice in choices.items():
            if choice not in built:
                built.add(choice)
                jobs.append((src, isa))

    def compile_one(job):
        src, isa = job
        cmd = cpu_kernels.compile_command([src], os.devnull, ISAS[isa][0], shared=False)
        return job, cmd, subprocess.run(cmd, capture_output=True, text=True, check=False)

    jobs.sort(key=lambda job: -job[0].stat().st_size)  # the longest first, on every core
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        runs = list(pool.map(compile_one, jobs))
    failed = [f"{src.name} for {isa} ({' '.join(cmd)}):\n{run.stderr[-3000:]}"
              for (src, isa), cmd, run in runs if run.returncode != 0]
    assert not failed, "\n\n".join(failed)


def test_a_new_build_prunes_only_stale_builds(tmp_path):
    import os
    import time

    keep, fresh, stale = (tmp_path / f"cpu_kernels-{k}.so" for k in ("new", "fresh", "stale"))
    for f in (keep, fresh, stale):
        f.write_bytes(b"")
    old = time.time() - (cpu_kernels.STALE_DAYS + 1) * 86400
    os.utime(stale, (old, old))
    os.utime(keep, (old, old))  # the build being kept is never removed
    cpu_kernels._prune(keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name, keep.name]


@needs_kernels
def test_cpu_peaks_script_measures_the_fma_peak():
    """scripts/cpu_peaks.py builds and runs its loops and prints a positive rate a core and for
    all cores (docs/performance.md's peaks come from it)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    cpu = cpu_kernels.cpu_flags()
    if "avx512f" not in cpu and not {"avx2", "fma"} <= cpu:
        pytest.skip("no AVX-512 or AVX2 FMA: the script skips its FMA loop")
    script = Path(__file__).resolve().parent.parent / "scripts" / "cpu_peaks.py"
    done = subprocess.run([sys.executable, str(script), "--seconds=0.05"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fma = re.search(r"(?:AVX-512|AVX2) f32 FMA\s+(\d+)\s+(\d+)", done.stdout)
    assert fma, done.stdout
    one, total = map(int, fma.groups())
    assert one > 0 and total > 0
