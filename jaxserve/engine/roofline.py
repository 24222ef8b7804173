"""The roofline of the engine's compiled steps on a TPU chip (`jaxserve compile --topology`'s cost
report): what XLA's TPU cost model says a step costs beside what it must cost.

  compiled    `compiled.cost_analysis()`: flops, bytes accessed and optimal_seconds (per op the
              larger of its flops at the chip's peak and its bytes at HBM bandwidth, summed);
              Pallas kernels count through their pl.CostEstimate (pallas_kernels/tpu)
  necessary   per device: the weights read once (an untied embedding only at the step's
              rows), every row's KV pages at the bucket's full context read once (a window's
              pages only), the new KV written, each matmul's input read and output written once,
              the logits written; flops of the matmuls and of attention over that context
  roofline    max(necessary flops / peak flops, necessary bytes / HBM bandwidth)

A scanned step (scan_layers) is counted by XLA with its loop body once, so its cost comes from
unscanned compiles of the first one and two periods of layers (`extrapolate`), layers alike
within a period; an unscanned step's from the step itself.

The cost compiles turn XLA's memory-space assignment off (COST_OPTIONS): with it on, a weight
(or a small pool) XLA prefetches into VMEM is counted three times, read from HBM, written to
VMEM, read by its consumer, where HBM sees it once (an 8B-shaped layer: 625 MB counted, 331 MB
with it off, about the 330 MB the layer must move). With it off, each op reads and writes HBM
once: bytes accessed is HBM traffic, and optimal_seconds prices every op at HBM bandwidth.

These are compiler estimates, not measurements: no TPU has run them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxserve.runtime import abstract, sharding


COST_OPTIONS = {"xla_msa_enable": False}  # the cost compiles' (module docstring)


@dataclasses.dataclass(frozen=True)
class ChipPeak:
    flops_per_s: float  # dense bf16 matmul
    hbm_bytes_per_s: float


# Google Cloud's TPU pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e), per chip: peak bf16
# compute and HBM bandwidth. A topology device is a chip (megacore on v4 and v5p).
CHIP_PEAKS = {
    "TPU v4": ChipPeak(275e12, 1228e9),  # 275 TFLOP/s, 1,228 GB/s
    "TPU v5 lite": ChipPeak(197e12, 819e9),  # v5e: 197 TFLOP/s, 819 GB/s
    "TPU v5": ChipPeak(459e12, 2765e9),  # v5p: 459 TFLOP/s, 2,765 GB/s
    "TPU v5p": ChipPeak(459e12, 2765e9),
    "TPU v6 lite": ChipPeak(918e12, 1640e9),  # v6e (Trillium): 918 TFLOP/s, 1,640 GB/s
}


@dataclasses.dataclass(frozen=True)
class StepShape:
    tokens: int  # T, the token bucket
    rows: int  # S, page-table rows
    sampled: int  # rows whose logits the step computes
    pages_per_row: int  # P, the page-table width (the bucket's full context is P * B)

    @classmethod
    def of(cls, batch) -> "StepShape":
        return cls(batch.token_ids.shape[0], batch.attn.page_tables.shape[-2],
                   batch.logits_indices.shape[0], batch.attn.page_tables.shape[-1])


def _is_layer_matmul(path, leaf) -> bool:
    return "layers" in jax.tree_util.keystr(path) and len(leaf.shape) >= 2


def necessary(cfg, shape: StepShape, params, *, tp: int, page_size: int, act_bytes: int,
              kv_bytes: int, kv_scales: bool) -> tuple[int, int]:
    """(flops, bytes) a step of `shape` must spend on one device (module docstring), params the
    abstract per-device tree (runtime/abstract.py), act_bytes the activations' itemsize,
    kv_bytes the pages'."""
    t, rows, b = shape.tokens, min(shape.rows, shape.tokens), page_size
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)
    weights = matmul = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        n = int(np.prod(leaf.sharding.shard_shape(leaf.shape), dtype=np.int64))
        name = jax.tree_util.keystr(path)
        if "embed" in name and not cfg.tie_word_embeddings:
            weights += t * h * np.dtype(leaf.dtype).itemsize  # looked up, not read whole
            continue
        weights += n * np.dtype(leaf.dtype).itemsize
        if _is_layer_matmul(path, leaf):
            share = (cfg.num_experts_per_tok / cfg.num_experts) if "expert" in name else 1
            matmul += n * share
    slot = 2 * hkv * (d * kv_bytes + (4 if kv_scales else 0))  # a token's K and V, a layer
    keys = [min(shape.pages_per_row, math.ceil(w / b) + 1) * b if w else shape.pages_per_row * b
            for w in (cfg.layer_window(i) for i in range(cfg.num_layers))]
    kv = rows * slot * sum(keys) + t * slot * cfg.num_layers
    inter = (cfg.moe_intermediate_size * cfg.num_experts_per_tok if cfg.num_experts
             else cfg.intermediate_size) // tp
    # Each matmul's input read and output written once: q/k/v, attention out, o, gate/up, down.
    per_layer = (h + (hq + 2 * hkv) * d) + (2 * hq * d) + (hq * d + h) + (h + 2 * inter) + (
        inter + h)
    acts = t * act_bytes * (h + per_layer * cfg.num_layers) + shape.sampled * (
        h * act_bytes + cfg.vocab_size * 4)
    flops = (2 * t * matmul + 2 * shape.sampled * h * cfg.vocab_size
             + 4 * t * hq * d * sum(keys))
    return int(flops), int(weights + kv + acts)


def extrapolate(cost1: dict, cost2: dict, periods: float) -> dict:
    """The cost of `periods` periods of layers from compiles of one and two: layers alike, so
    each further period adds what the second added."""
    out = {k: cost1[k] + (periods - 1) * (cost2[k] - cost1[k]) for k in cost1}
    return {**out, "unpriced_ops": round(out["unpriced_ops"])}


def compiled_cost(compiled) -> dict:
    """flops, bytes accessed and optimal_seconds of a compiled executable. XLA prices an op of
    unknown cost at -1 s: its own ConcatBitcast (weights it prefetched into VMEM in slices put
    back together; the slices' copies are priced) has none, so each is added back; any other
    unpriced op (a kernel without a cost estimate) is counted in `unpriced_ops` and left."""
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    concat = compiled.as_text().count('custom_call_target="ConcatBitcast"')
    seconds = float(c.get("optimal_seconds", -1.0)) + concat
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c["bytes accessed"]),
            "estimated_seconds": seconds, "unpriced_ops": max(0, -math.floor(seconds))}


def shape_report(shape: StepShape, cost: dict, need: tuple[int, int], peak: ChipPeak) -> dict:
    """One step shape's line of the report: the compiled cost beside the roofline."""
    flops, nbytes = need
    roof = max(flops / peak.flops_per_s, nbytes / peak.hbm_bytes_per_s)
    return {"tokens": shape.tokens, "rows": shape.rows, "sampled_rows": shape.sampled,
            "pages_per_row": shape.pages_per_row, "flops": int(cost["flops"]),
            "bytes_accessed": int(cost["bytes_accessed"]),
            "estimated_seconds": cost["estimated_seconds"], "unpriced_ops": cost["unpriced_ops"],
            "necessary_flops": flops,
            "necessary_bytes": nbytes, "roofline_seconds": roof,
            "bytes_ratio": round(cost["bytes_accessed"] / nbytes, 3),
            "seconds_ratio": round(cost["estimated_seconds"] / roof, 3)}


def throughput(shapes: list[dict], page_size: int) -> dict:
    """Estimated tok/s: decode as rows / seconds of the largest decode step (one token a row,
    every row at the bucket's full context), prefill as tokens / seconds of the largest step."""
    shapes = [s for s in shapes if s["estimated_seconds"] > 0 and not s["unpriced_ops"]]
    decode = [s for s in shapes if s["tokens"] <= s["rows"]]
    out = {}
    if decode:
        d = max(decode, key=lambda s: s["tokens"])
        out["decode"] = {"rows": d["tokens"], "context": d["pages_per_row"] * page_size,
                         "tokens_per_s": round(d["tokens"] / d["estimated_seconds"], 1),
                         "roofline_tokens_per_s": round(d["tokens"] / d["roofline_seconds"], 1)}
    if shapes:
        p = max(shapes, key=lambda s: s["tokens"])
        out["prefill"] = {"tokens": p["tokens"], "context": p["pages_per_row"] * page_size,
                          "tokens_per_s": round(p["tokens"] / p["estimated_seconds"], 1),
                          "roofline_tokens_per_s": round(p["tokens"] / p["roofline_seconds"], 1)}
    return out


def report(target, batches: dict, costs: dict, periods: float) -> dict:
    """The roofline report of an aot.Target's compiled steps: batches[i] the i-th step shape's
    batch, costs[("cost 0", i)] its cost compile's (`compiled_cost`), and for a scanned target
    costs[("cost 1", i)] too: one and two periods of layers (`extrapolate` over `periods`)."""
    peak = CHIP_PEAKS.get(target.topology.device_kind)
    if peak is None:
        return {"error": f"no peak figures for {target.topology.device_kind!r}"}
    params = abstract.abstract_params(target.model, target.mesh, target.dtype)
    shapes = []
    for i, batch in sorted(batches.items()):
        if ("cost 0", i) in costs and ("cost 1", i) in costs:
            cost = extrapolate(costs["cost 0", i], costs["cost 1", i], periods)
        elif ("cost 0", i) in costs and periods == 1:
            cost = costs["cost 0", i]
        else:
            continue  # its compile failed (listed in failures)
        shape = StepShape.of(batch)
        need = necessary(
            target.model, shape, params, tp=sharding.tp_size(target.mesh),
            page_size=target.page_size, act_bytes=np.dtype(abstract.JNP_DTYPES[
                target.dtype]).itemsize, kv_bytes=np.dtype(abstract.JNP_DTYPES[
                    target.kv_dtype]).itemsize, kv_scales=target.kv_dtype == "int8")
        shapes.append(shape_report(shape, cost, need, peak))
    return {"chip": {"device_kind": target.topology.device_kind,
                     "flops_per_s": peak.flops_per_s, "hbm_bytes_per_s": peak.hbm_bytes_per_s},
            "counted_from": ("unscanned compiles of 1 and 2 layer periods, extrapolated"
                             if target.scan_layers else "the steps")
            + ", memory-space assignment off (HBM bytes)",
            "steps": shapes, "throughput": throughput(shapes, target.page_size)}
