"""The C++ CPU backend's matmuls (f32 panels, bf16 AMX tiles, 4-bit levels against int8, a mixture
of experts' grouped matmul) and greedy argmax against numpy, the weight layouts they read, and the
packed model computing the same products (int8 too; the int8 matmul against the dequantized
product is in test_quantize.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends.cpu import kernels as cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"kernel not built: {cpu_kernels.unavailable_reason()}")


# 101 rows: on two cores past kSplitRowsPerThread (rows split over the threads, packed), with a
# partial last tile.
@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 5, 8, 13, 70, 101])
@pytest.mark.parametrize("k,n", [(576, 960), (40, 7), (64, 49), (576, 6000)])
def test_f32_matmul_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * 100 + k + n)
    w = rng.standard_normal((n, k)).astype(np.float32)  # [out, in]
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = cpu_kernels.matmul_f32(jnp.asarray(x), jnp.asarray(cpu_kernels.pack_panels(w)), n)
    assert got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), x @ w.T, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("rows,width", [(1, 5), (3, 16), (7, 33), (256, 49152), (2, 49157)])
def test_argmax_matches_numpy_with_ties(rows, width):
    rng = np.random.default_rng(width)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    x[0, [width - 1, width // 2]] = 50.0  # a tie across vector lanes and the tail: lowest wins
    if rows > 1:
        x[-1, :] = -np.inf  # all -inf: index 0
    ids, values = jax.jit(cpu_kernels.argmax)(x)
    np.testing.assert_array_equal(np.asarray(ids), x.argmax(-1))
    np.testing.assert_array_equal(np.asarray(values), x.max(-1))
    assert ids.dtype == jnp.int32


def test_pack_panels_layout():
    w = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)  # [out, in]
    panels = cpu_kernels.pack_panels(w)
    assert panels.shape == (2, 3, 48)
    np.testing.assert_array_equal(panels[0, :, 5], w[5])  # column 5 of W = [in, out]
    np.testing.assert_array_equal(panels[1, :, 1], w[49])
    assert not panels[1, :, 2:].any()  # zero past N


def test_pack_nibbles_layout():
    q = np.arange(2 * 4 * 48).reshape(2, 4, 48) % 16
    nibbles = cpu_kernels.pack_nibbles(q.astype(np.int8))
    assert nibbles.dtype == np.uint8 and nibbles.shape == (2, 2, 48)
    np.testing.assert_array_equal(nibbles[1, 1] & 15, q[1, 2])  # k even: the low nibble
    np.testing.assert_array_equal(nibbles[1, 1] >> 4, q[1, 3])
    with pytest.raises(ValueError, match="0..15"):
        cpu_kernels.pack_nibbles(np.full((1, 2, 48), 16, np.int8))


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 8, 11, 40])
@pytest.mark.parametrize("k,n", [(576, 960), (32, 7), (1536, 100), (64, 49)])
def test_q4_1_weights_pack_two_levels_a_byte_with_int8_results_bit_for_bit(m, k, n):
    """A weight of GGUF Q4_1 blocks (levels 0..15) is packed two levels a byte, and its matmul
    gives the int8 kernel's results, exactly on the vector paths (the same float levels summed in
    the same order; checked on AVX-512 and, built with -march=haswell, AVX2), at
    the group-sum tiles (1-2 rows), the dequantizing tiles (to 8) and the f32 panel copy (past
    8); a weight with any other level stays int8."""
    from jaxserve.backends.cpu.packing import pack
    from jaxserve.model.quantize import GROUP, quantize_weight

    rng = np.random.default_rng(m * 1000 + k + n)
    d = rng.uniform(1e-3, 0.1, (k // GROUP, 1, n)).astype(np.float16).astype(np.float32)
    lo = -rng.uniform(0, 1, (k // GROUP, 1, n)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (k // GROUP, GROUP, n))
    q[:, 0], q[:, 1] = 0, 15
    w = quantize_weight((d * q + lo).reshape(k, n))
    packed = pack(w)
    assert packed.panels.dtype == np.uint8 and packed.panels.shape[1] == k // 2
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    as_int8 = [cpu_kernels.pack_panels(np.asarray(a)) for a in (w.q_t, w.scale, w.offset)]
    want, got = cpu_kernels.matmul_int8(x, *as_int8, n), packed.matmul(x)
    if cpu_kernels.has_vector_path():  # the portable fallback's FMAs may contract differently
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * np.abs(np.asarray(want)).max())
    np.testing.assert_allclose(np.asarray(want), np.asarray(x) @ w.dequantize().T, rtol=1e-4,
                               atol=1e-4 * np.abs(np.asarray(want)).max())
    w.q_t[0, 0] = -1
    assert pack(w).panels.dtype == np.int8


@needs_kernels
def test_matmul_shape_errors_are_reported():
    x = jnp.ones((2, 8), jnp.float32)
    panels = jnp.ones((2, 8, 48), jnp.float32)
    with pytest.raises(Exception, match="48"):
        jax.block_until_ready(cpu_kernels.matmul_f32(x, panels, 40))  # N must need both panels


@needs_kernels
@pytest.mark.parametrize("m", [1, 5, 17, 33, 70])
@pytest.mark.parametrize("k,n", [(576, 960), (40, 7), (64, 49), (1536, 576)])
def test_bf16_matmul_matches_the_product_of_rounded_inputs(m, k, n):
    if not cpu_kernels.amx_bf16_available():
        pytest.skip("no AMX-BF16 here")
    rng = np.random.default_rng(m * 100 + k + n)
    w = rng.standard_normal((n, k)).astype(np.float32)  # [out, in]
    x = rng.standard_normal((m, k)).astype(np.float32)
    rounded = lambda a: a.astype(jnp.bfloat16).astype(np.float64)  # noqa: E731
    want = rounded(x) @ rounded(w).T
    got = cpu_kernels.matmul_bf16(jnp.asarray(x), jnp.asarray(cpu_kernels.pack_bf16_tiles(w)), n)
    assert got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_bf16_tiles_pair_rows_of_k_for_each_column():
    w = np.arange(37 * 40, dtype=np.float32).reshape(37, 40) / 7  # [out, in]
    tiles = cpu_kernels.pack_bf16_tiles(w)
    assert tiles.dtype == np.uint16 and tiles.shape == (3, 32, 16, 2)  # K 40 -> 64, N 37 -> 48
    as_float = tiles.view(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(as_float[1, 3, 4], w[20, 6:8].astype(jnp.bfloat16))
    assert not as_float[2, :, 5:].any() and not as_float[:, 20:].any()  # zero past N and K


@needs_kernels
@pytest.mark.parametrize("kind", ["f32", "int8", "bf16"])
def test_cpu_layout_runs_the_kernels_with_the_same_products(kind):
    """The cpu backend's pack_params packs every projection, the head and a tied embedding; the
    packed model computes the same products (bf16: of bf16-rounded inputs) and looks up the
    same rows."""
    from jaxserve.backends.cpu.packing import PanelWeight, pack_params
    from jaxserve.model import llama

    rng = np.random.default_rng(5)
    h, inter, vocab = 64, 96, 100
    layers = {name: rng.standard_normal((1, *shape)).astype(np.float32)
              for name, shape in [("wq", (h, h)), ("wk", (h, 32)), ("wv", (h, 32)), ("wo", (h, h)),
                                  ("w_gate", (h, inter)), ("w_up", (h, inter)),
                                  ("w_down", (inter, h))]}
    layers |= {"attn_norm": np.ones((1, h), np.float32), "mlp_norm": np.ones((1, h), np.float32)}
    params = {"embed": rng.standard_normal((vocab, h)).astype(np.float32),
              "final_norm": np.ones(h, np.float32), "layers": layers}
    from jaxserve.model.quantize import quantize

    if kind == "bf16" and not cpu_kernels.amx_bf16_available():
        pytest.skip("no AMX-BF16 here")
    if kind in ("int8", "bf16"):
        params = quantize(params, kind)
    plain = llama.per_layer_params(params)
    packed = pack_params(plain)
    weights = lambda p: [p["layers"][0][k] for k in ("w_qkv", "wo", "w_gate_up", "w_down")]  # noqa: E731
    head = lambda p: p["lm_head"] if "lm_head" in p else p["embed"]  # noqa: E731
    target = f"jaxserve_matmul_{kind}"
    for wp, wx in zip(weights(packed) + [head(packed)], weights(plain) + [head(plain)]):
        assert isinstance(wp, PanelWeight) and not isinstance(wx, PanelWeight)
        k = (wx["q_t"] if isinstance(wx, dict) else wx).shape[1]
        x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
        assert target in jax.jit(lambda x: llama.matmul(x, wp)).lower(x).as_text()
        assert "jaxserve" not in jax.jit(lambda x: llama.matmul(x, wx)).lower(x).as_text()
        x_ref = x.astype(jnp.bfloat16).astype(jnp.float32) if kind == "bf16" else x
        np.testing.assert_allclose(np.asarray(llama.matmul(x, wp)),
                                   np.asarray(llama.matmul(x_ref, wx)), rtol=1e-4, atol=1e-4)
    ids = jnp.asarray([0, 47, 48, 99], jnp.int32)
    np.testing.assert_array_equal(np.asarray(llama.embed(packed, ids)), params["embed"][ids])


@needs_kernels
@pytest.mark.parametrize("sizes", [[1, 0, 0, 1, 1, 0, 1, 0], [0, 9, 0, 0, 30, 1, 0, 2],
                                   [0] * 8, [3, 0, 0, 0, 0, 0, 0, 0]])
@pytest.mark.parametrize("k,n", [(512, 512), (64, 49), (40, 7)])
def test_expert_matmul_multiplies_each_group_by_its_expert(sizes, k, n):
    """Rows in groups (one row each, as a decode step's pairs; uneven; none), and rows past the
    last group: each group's rows times its own expert, the rest zero."""
    rng = np.random.default_rng(len(sizes) + k)
    m = sum(sizes) + 3
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    panels = np.stack([cpu_kernels.pack_panels(e.T) for e in w])
    y = np.asarray(cpu_kernels.expert_matmul_f32(jnp.asarray(x), panels, np.array(sizes), n))
    ends = np.cumsum(sizes)
    want = np.zeros((m, n), np.float32)
    for e, (end, size) in enumerate(zip(ends, sizes)):
        want[end - size:end] = x[end - size:end] @ w[e]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_expert_matmul_refuses_group_sizes_past_the_rows():
    panels = np.zeros((2, 1, 32, 48), np.float32)
    with pytest.raises(Exception, match="sum past x's rows"):
        jax.block_until_ready(cpu_kernels.expert_matmul_f32(jnp.zeros((3, 32)), panels,
                                                        np.array([2, 2]), 48))


@needs_kernels
@pytest.mark.parametrize("levels", ["int8", "4-bit"])
@pytest.mark.parametrize("sizes", [[1, 0, 1, 0, 0, 1], [12, 0, 0, 30, 1, 0]])
def test_int8_expert_matmul_equals_the_dequantized_product(levels, sizes):
    """Int8 experts (4-bit ones when every group is a Q4_1 block: packed two a byte) against
    each group's rows times its expert's dequantized weight."""
    from jaxserve.backends.cpu.packing import pack_experts
    from jaxserve.model.quantize import quantize_weight

    rng = np.random.default_rng(7)
    e, k, n, m = len(sizes), 96, 100, sum(sizes) + 2
    if levels == "4-bit":  # each group of 32 k: levels 0..15 with both ends present
        q = rng.integers(0, 16, (e, k, n))
        q[:, ::32], q[:, 1::32] = 0, 15
        w = (0.125 * q - 1.0).astype(np.float32)
    else:
        w = rng.standard_normal((e, k, n)).astype(np.float32)
    quantized = quantize_weight(w)
    packed = pack_experts(quantized)
    assert packed.panels.dtype == (np.uint8 if levels == "4-bit" else np.int8)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(packed.grouped_matmul(jnp.asarray(x), np.array(sizes)))
    dense = np.swapaxes(quantized.dequantize(), -1, -2)
    want, row = np.zeros((m, n), np.float32), 0
    for expert, size in enumerate(sizes):
        want[row:row + size] = x[row:row + size] @ dense[expert]
        row += size
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("sizes", [[1, 0, 2, 0, 1, 2], [0, 40, 0, 33, 17, 0]])
def test_bf16_expert_matmul_equals_the_product_of_rounded_inputs(sizes):
    """bfloat16 experts on AMX tiles: each group's rows (rounded to bfloat16) times its expert,
    groups of one row (decode) and of several row blocks, rows past the last group zero."""
    if not cpu_kernels.amx_bf16_available():
        pytest.skip("AMX-BF16 unavailable")
    from jaxserve.backends.cpu.packing import pack_experts

    rng = np.random.default_rng(11)
    e, k, n, m = len(sizes), 96, 100, sum(sizes) + 2
    w = rng.standard_normal((e, k, n)).astype(jnp.bfloat16)
    packed = pack_experts(w)
    assert packed.panels.dtype == np.uint16
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(packed.grouped_matmul(jnp.asarray(x), np.array(sizes)))
    rounded = x.astype(jnp.bfloat16).astype(np.float32)
    want, row = np.zeros((m, n), np.float32), 0
    for expert, size in enumerate(sizes):
        want[row:row + size] = rounded[row:row + size] @ w[expert].astype(np.float32)
        row += size
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)
