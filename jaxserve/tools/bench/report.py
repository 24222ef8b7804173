"""Benchmark metrics from a RunResult: per-request latencies -> mean/p50/p90/p99, throughput,
goodput under SLOs, KV memory at its peak (measured vs analytic), latency by length bucket; a
console table, a JSON-ready dict, an ablation table and plots (PNG+SVG+CSV via jaxserve.tools.plots).

Definitions (seconds; per completed request):
- TTFT = first output token - arrival (arrival is the scheduled arrival time).
- ITL = gaps between consecutive output tokens (every gap of every request, pooled).
- TPOT = (E2E - TTFT) / (output tokens - 1), for requests with >= 2 output tokens.
- E2E = last token - arrival.
- Throughput = totals / duration, the duration running from the first arrival to the last request
  done. Goodput = completed requests meeting every stated SLO, per second.
Percentiles interpolate linearly between order statistics (numpy's default, as vLLM's bench).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from jaxserve.tools.bench.runner import STATUSES, RunResult

PERCENTILES = (50, 90, 99)
MIB = 1 << 20

__all__ = ["summarize", "percentile", "build_report", "format_report", "format_ablation",
           "write_plots", "length_buckets", "greedy_agreement"]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks: rank = q/100 * (n - 1)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = q / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def greedy_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How closely two systems' outputs for the same requests agree: the requests whose tokens
    are identical, and the tokens each output matches before its first difference (summed and
    averaged over the requests)."""
    prefixes = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                for p, q in zip(a, b)]
    return {"identical_requests": sum(list(p) == list(q) for p, q in zip(a, b)),
            "requests": len(prefixes), "matching_prefix_tokens": sum(prefixes),
            "mean_matching_prefix": sum(prefixes) / max(len(prefixes), 1)}


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99, min, max and count of `values` (NaN when empty)."""
    xs = [float(v) for v in values]
    out = {"mean": float(np.mean(xs)) if xs else math.nan}
    out.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    out.update(min=min(xs) if xs else math.nan, max=max(xs) if xs else math.nan, n=len(xs))
    return out


def _request_latencies(rec) -> dict[str, Any]:
    ttft = rec.first_token - rec.arrival if rec.first_token is not None else None
    end = rec.token_times[-1] if rec.token_times else rec.finished
    e2e = end - rec.arrival if end is not None else None
    tpot = ((e2e - ttft) / (rec.output_tokens - 1)
            if ttft is not None and e2e is not None and rec.output_tokens > 1 else None)
    itl = list(np.diff(rec.token_times)) if len(rec.token_times) > 1 else []
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "itl": itl}


def length_buckets(lengths: Sequence[int], max_buckets: int = 4) -> list[tuple[int, int]]:
    """Inclusive [lo, hi] ranges splitting the observed lengths at quantiles; no empty bucket."""
    xs = sorted(int(v) for v in lengths)
    if not xs:
        return []
    distinct = sorted(set(xs))
    if len(distinct) <= max_buckets:
        return [(v, v) for v in distinct]
    edges = sorted(set(int(math.floor(percentile(xs, 100 * k / max_buckets)))
                       for k in range(1, max_buckets)))
    out, lo = [], xs[0]
    for e in edges + [xs[-1]]:
        if e >= lo and any(lo <= v <= e for v in xs):
            out.append((lo, e))
            lo = e + 1
    return out


def _by_bucket(rows: list[dict], key: str) -> list[dict[str, Any]]:
    out = []
    for lo, hi in length_buckets([r[key] for r in rows]):
        sel = [r for r in rows if lo <= r[key] <= hi]
        out.append({"range": [lo, hi], "n": len(sel),
                    "ttft_mean_ms": _ms(np.mean([r["ttft"] for r in sel])),
                    "tpot_mean_ms": _ms(_mean([r["tpot"] for r in sel if r["tpot"] is not None])),
                    "e2e_mean_ms": _ms(np.mean([r["e2e"] for r in sel])),
                    "e2e_p90_ms": _ms(percentile([r["e2e"] for r in sel], 90))})
    return out


def _mean(xs):
    return float(np.mean(xs)) if len(xs) else math.nan


def _ms(x: float) -> float:
    return float(x) * 1000.0


def _ms_summary(values: Sequence[float]) -> dict[str, float]:
    s = summarize(values)
    return {k: (v * 1000.0 if k != "n" else v) for k, v in s.items()}


def build_report(result: RunResult, *, workload=None, slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None, label: str = "") -> dict[str, Any]:
    """Everything the evaluation protocol asks for, as a JSON-ready dict (latencies in ms)."""
    records = result.records
    counts = {s: sum(1 for r in records if r.status == s) for s in STATUSES}
    done = [r for r in records if r.status == "completed"]
    rows = []
    for r in done:
        lat = _request_latencies(r)
        rows.append(dict(lat, prompt_len=r.prompt_len, output_len=r.output_tokens))
    duration = result.duration_s if result.duration_s > 0 else math.nan
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    good = [x for x in rows
            if (slo_ttft_ms is None or (x["ttft"] is not None and x["ttft"] * 1000 <= slo_ttft_ms))
            and (slo_tpot_ms is None or x["tpot"] is None or x["tpot"] * 1000 <= slo_tpot_ms)]
    report: dict[str, Any] = {
        "label": label, "mode": result.mode,
        "workload": workload.to_dict() if workload is not None else None,
        "workload_description": workload.describe() if workload is not None else None,
        "num_prompts": len(records), **counts,
        "duration_s": result.duration_s,
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "target_output_tokens": sum(r.target_output_len for r in done),
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "ttft_ms": _ms_summary([x["ttft"] for x in rows if x["ttft"] is not None]),
        "itl_ms": _ms_summary([g for x in rows for g in x["itl"]]),
        "tpot_ms": _ms_summary([x["tpot"] for x in rows if x["tpot"] is not None]),
        "e2e_ms": _ms_summary([x["e2e"] for x in rows if x["e2e"] is not None]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "goodput": {"requests": len(good), "requests_per_s": len(good) / duration,
                    "fraction": len(good) / len(done) if done else 0.0},
        "by_prompt_len": _by_bucket(rows, "prompt_len") if rows else [],
        "by_output_len": _by_bucket(rows, "output_len") if rows else [],
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    info = result.engine
    if result.mode == "engine":
        peak = info["kv_peak"]
        b, bps = info["page_size"], peak["bytes_per_slot"]
        page_bytes = b * bps
        ref = max(peak["referenced_pages"], 0)
        queries = info["prefix_cache_queries"]
        report.update({
            "backend": info["backend"], "engine_config": info["config"],
            "max_model_len": info["max_model_len"],
            "num_pages": info["num_pages"], "page_size": b,
            "kv_pool_bytes": info["kv_pool_bytes"], "weight_bytes": info["weight_bytes"],
            "peak_kv_pages": ref,
            "peak_kv_bytes": ref * page_bytes,
            "kv_at_peak": {
                "step": peak.get("step"), "t_s": peak.get("t"),
                "live_sequences": len(peak.get("live_lengths", [])),
                "useful_bytes": peak.get("useful_slots", 0) * bps,
                "fragmentation_bytes": peak.get("fragmented_slots", 0) * bps,
                "page_table_bytes": peak.get("page_table_bytes", 0),
                "cached_unreferenced_bytes": peak.get("cached_pages", 0) * page_bytes,
                "free_bytes": peak.get("free_pages", 0) * page_bytes,
                "scratch_bytes": page_bytes,
                "measured_pages": ref,
                "analytic_pages": peak.get("analytic_pages", 0),
                "live_lengths": peak.get("live_lengths", []),
            },
            "peak_rss_bytes": info["peak_rss_bytes"],
            "preemptions": info["preemptions"],
            "speculation": _speculation(info),
            "prefix_cache_hit_rate": info["prefix_cache_hits"] / queries if queries else 0.0,
            "compilations_warmup": info["compilations_before_warmup"] + info["compilations_warmup"],
            "compilations_after_warmup": info["compilations_after_warmup"],
            # The measured window's latencies include these compilations: said in the header.
            "warnings": ([f"{info['compilations_after_warmup']} step shapes compiled during the "
                          "measured window: its latencies include XLA compilation (warm up "
                          "with --compile_warmup)"] if info["compilations_after_warmup"] else []),
            "warmup_requests": info["warmup_requests"], "warmup_s": info["warmup_s"],
        })
    else:
        report.update({"url": info.get("url"), "peak_rss_bytes": info.get("peak_rss_bytes"),
                       "warmup_requests": info.get("warmup_requests")})
    return report


# ---------------------------------------------------------------------------------------------
# Console


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.{digits}f}"
    return str(v)


def format_report(rep: dict[str, Any]) -> str:
    lines = []
    title = f"Benchmark{(' - ' + rep['label']) if rep.get('label') else ''}"
    lines += [title, "=" * len(title)]
    lines += [f"WARNING: {w}" for w in rep.get("warnings", [])]
    if rep.get("workload_description"):
        lines.append(f"workload: {rep['workload_description']}")
    if rep["mode"] == "engine":
        cfg = rep["engine_config"]
        lines.append(f"engine: {cfg['model']}, {cfg['dtype']}, backend {rep['backend']}, page "
                     f"{rep['page_size']}, {rep['num_pages']} pages, max_num_seqs "
                     f"{cfg['max_num_seqs']}, max_num_batched_tokens "
                     f"{cfg['max_num_batched_tokens']}, scheduling {cfg['scheduling']}, prefix "
                     f"caching {'on' if cfg['enable_prefix_caching'] else 'off'}")
    else:
        lines.append(f"server: {rep['url']}")
    lines.append("")
    kv = [("requests: completed / rejected / cancelled / failed",
           f"{rep['completed']} / {rep['rejected']} / {rep['cancelled']} / {rep['failed']}"),
          ("duration (s)", _fmt(rep["duration_s"], 2)),
          ("output tokens (prompt tokens)", f"{rep['output_tokens']} ({rep['prompt_tokens']})"),
          ("request throughput (req/s)", _fmt(rep["request_throughput"], 3)),
          ("output token throughput (tok/s)", _fmt(rep["output_throughput"], 2)),
          ("total token throughput (tok/s, incl. prompt)", _fmt(rep["total_token_throughput"], 2))]
    slo = rep["slo"]
    if slo["ttft_ms"] is not None or slo["tpot_ms"] is not None:
        kv.append((f"goodput (TTFT <= {_fmt(slo['ttft_ms'], 0)} ms, TPOT <= "
                   f"{_fmt(slo['tpot_ms'], 0)} ms)",
                   f"{rep['goodput']['requests_per_s']:.3f} req/s "
                   f"({100 * rep['goodput']['fraction']:.1f}% of completed)"))
    width = max(len(k) for k, _ in kv)
    lines += [f"{k:<{width}}  {v}" for k, v in kv]
    lines += ["", f"{'latency (ms)':<24}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name, key in (("TTFT", "ttft_ms"), ("inter-token (ITL)", "itl_ms"),
                      ("per output token (TPOT)", "tpot_ms"), ("end-to-end (E2E)", "e2e_ms")):
        s = rep[key]
        lines.append(f"{name:<24}" + "".join(f"{_fmt(s[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    if rep["mode"] == "engine":
        pk = rep["kv_at_peak"]
        bps_page = rep["peak_kv_bytes"] / max(rep["peak_kv_pages"], 1)
        lines += ["", "memory"]
        mem = [("peak KV pages referenced (measured)", f"{pk['measured_pages']} of "
                f"{rep['num_pages'] - 1} usable ({_fmt(rep['peak_kv_bytes'] / MIB)} MiB)"),
               ("analytic pages for the lengths live at that step",
                f"{pk['analytic_pages']} (kv_budget.pages_needed over {pk['live_sequences']} "
                f"sequences)"),
               ("  useful KV", f"{_fmt(pk['useful_bytes'] / MIB, 2)} MiB"),
               ("  last-page fragmentation", f"{_fmt(pk['fragmentation_bytes'] / MIB, 2)} MiB"),
               ("  page tables (host)", f"{pk['page_table_bytes']} B"),
               ("  cached (unreferenced) pages", f"{_fmt(pk['cached_unreferenced_bytes'] / MIB, 2)} MiB"),
               ("  free pages", f"{_fmt(pk['free_bytes'] / MIB, 2)} MiB"),
               ("  scratch page", f"{_fmt(pk['scratch_bytes'] / MIB, 2)} MiB"),
               ("KV pool / weights", f"{_fmt(rep['kv_pool_bytes'] / MIB)} MiB / "
                f"{_fmt(rep['weight_bytes'] / MIB)} MiB"),
               ("peak process RSS", f"{_fmt(rep['peak_rss_bytes'] / MIB)} MiB"),
               ("preemptions", str(rep["preemptions"])),
               ("speculative decoding", _speculation_line(rep.get("speculation"))),
               ("prefix-cache hit rate (tokens)", f"{100 * rep['prefix_cache_hit_rate']:.1f}%"),
               ("compilations: up to warm-up / after",
                f"{rep['compilations_warmup']} / {rep['compilations_after_warmup']} "
                f"({rep['warmup_requests']} warm-up requests)")]
        width = max(len(k) for k, _ in mem)
        lines += [f"{k:<{width}}  {v}" for k, v in mem]
        del bps_page
    elif rep.get("peak_rss_bytes"):
        lines += ["", f"peak server RSS  {_fmt(rep['peak_rss_bytes'] / MIB)} MiB"]
    for key, name in (("by_prompt_len", "prompt length"), ("by_output_len", "output length")):
        if len(rep[key]) > 1:
            lines += ["", f"{'by ' + name:<18}{'n':>5}{'TTFT ms':>11}{'TPOT ms':>11}{'E2E ms':>11}"
                      f"{'E2E p90':>11}"]
            for b in rep[key]:
                lo, hi = b["range"]
                rng = f"{lo}" if lo == hi else f"{lo}..{hi}"
                lines.append(f"{rng:<18}{b['n']:>5}{_fmt(b['ttft_mean_ms']):>11}"
                             f"{_fmt(b['tpot_mean_ms']):>11}{_fmt(b['e2e_mean_ms']):>11}"
                             f"{_fmt(b['e2e_p90_ms']):>11}")
    if rep["errors"]:
        lines += ["", "errors (first 5 distinct):"] + [f"  {e}" for e in rep["errors"]]
    return "\n".join(lines)


ABLATION_COLUMNS = (
    ("out tok/s", lambda r: r["output_throughput"], 1),
    ("req/s", lambda r: r["request_throughput"], 2),
    ("TTFT mean", lambda r: r["ttft_ms"]["mean"], 0),
    ("TTFT p99", lambda r: r["ttft_ms"]["p99"], 0),
    ("TPOT mean", lambda r: r["tpot_ms"]["mean"], 1),
    ("ITL p99", lambda r: r["itl_ms"]["p99"], 1),
    ("E2E p90", lambda r: r["e2e_ms"]["p90"], 0),
    ("peak pages", lambda r: r.get("peak_kv_pages"), 0),
    ("peak KV MiB", lambda r: r.get("peak_kv_bytes", 0) / MIB, 1),
    ("preempt", lambda r: r.get("preemptions"), 0),
    ("hit %", lambda r: 100 * r.get("prefix_cache_hit_rate", 0.0), 1),
    ("done", lambda r: r["completed"], 0),
)


def format_ablation(pairs: list[tuple[str, dict, dict]], notes: Sequence[str] = ()) -> str:
    """One table: for each ablation its baseline row, its variant row and the variant/baseline
    ratio (latencies in ms)."""
    head = f"{'ablation / variant':<34}" + "".join(f"{name:>12}" for name, _, _ in ABLATION_COLUMNS)
    lines = [head, "-" * len(head)]
    for name, base, var in pairs:
        for rep in (base, var):
            cells = []
            for _, get, digits in ABLATION_COLUMNS:
                v = get(rep)
                cells.append(f"{_fmt(float(v) if v is not None else None, digits):>12}")
            lines.append(f"{name + ': ' + rep['label']:<34}" + "".join(cells))
        ratios = []
        for _, get, _ in ABLATION_COLUMNS:
            a, b = get(base), get(var)
            ratios.append(f"{'x' + format(b / a, '.2f') if a and b is not None else '-':>12}")
        lines.append(f"{'  ratio (variant / baseline)':<34}" + "".join(ratios))
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def write_plots(rep: dict[str, Any], result: RunResult, out_dir: str,
                prefix: str = "bench") -> dict[str, dict[str, str]]:
    """latency CDFs; output throughput over time; KV pages and RSS over time."""
    from jaxserve.tools import plots

    paths = {}
    done = [r for r in result.records if r.status == "completed"]
    lats = [_request_latencies(r) for r in done]
    series = {"TTFT": [x["ttft"] * 1000 for x in lats if x["ttft"] is not None],
              "TPOT": [x["tpot"] * 1000 for x in lats if x["tpot"] is not None],
              "ITL": [g * 1000 for x in lats for g in x["itl"]],
              "E2E": [x["e2e"] * 1000 for x in lats if x["e2e"] is not None]}
    fig, ax = plots.new_figure()
    rows = []
    for name, vals in series.items():
        if not vals:
            continue
        xs, ys = _cdf(vals)
        ax.plot(xs, ys, label=f"{name} (p50 {percentile(vals, 50):,.0f} ms)")
        rows += [[name, x, y] for x, y in zip(xs, ys)]
    ax.set_xscale("log")
    ax.set(title=f"Latency CDFs{' - ' + rep['label'] if rep.get('label') else ''}",
           xlabel="latency (ms, log scale)", ylabel="fraction of requests / gaps")
    ax.legend(fontsize="small")
    paths["latency_cdf"] = plots.save_bundle(fig, out_dir, f"{prefix}_latency_cdf",
                                             ["metric", "ms", "fraction"], rows)

    stamps = sorted(t for r in done for t in r.token_times)
    if stamps:
        span = max(stamps[-1], 1e-6)
        width = max(span / 40.0, 0.25)
        edges = np.arange(0.0, span + width, width)
        counts, _ = np.histogram(stamps, bins=edges)
        mids = (edges[:-1] + edges[1:]) / 2
        tput = counts / width
        fig, ax = plots.new_figure()
        ax.step(mids, tput, where="mid")
        ax.set(title=f"Output token throughput over time ({width:.2g} s bins)",
               xlabel="time since start (s)", ylabel="output tokens/s")
        paths["throughput"] = plots.save_bundle(
            fig, out_dir, f"{prefix}_throughput", ["t_s", "output_tokens_per_s"],
            [[float(m), float(v)] for m, v in zip(mids, tput)])

    tl = result.timeline
    if tl:
        fig, ax = plots.new_figure()
        t = [s["t"] for s in tl]
        header, cols = ["t_s"], [t]
        if "referenced_pages" in tl[0]:
            ax.plot(t, [s["referenced_pages"] for s in tl], label="KV pages referenced", color="C0")
            ax.plot(t, [math.ceil(s["useful_slots"] / rep["page_size"]) for s in tl],
                    label="pages of useful KV (ceil(slots / B))", color="C0", linestyle=":")
            if rep.get("num_pages"):
                ax.axhline(rep["num_pages"] - 1, color="grey", linestyle="--",
                           label=f"usable pages ({rep['num_pages'] - 1})")
            ax.set_ylabel("KV pages")
            header += ["referenced_pages", "useful_slots", "running", "waiting"]
            cols += [[s["referenced_pages"] for s in tl], [s["useful_slots"] for s in tl],
                     [s["running"] for s in tl], [s["waiting"] for s in tl]]
        ax2 = ax.twinx()
        ax2.plot(t, [s["rss"] / MIB for s in tl], color="C3", label="process RSS (MiB)")
        ax2.set_ylabel("RSS (MiB)", color="C3")
        header.append("rss_mib")
        cols.append([s["rss"] / MIB for s in tl])
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize="small", loc="lower right")
        ax.set(title="KV pages and process memory over time", xlabel="time since start (s)")
        paths["memory"] = plots.save_bundle(fig, out_dir, f"{prefix}_memory", header,
                                            [list(r) for r in zip(*cols)])
    return paths


def _speculation(info: dict) -> dict | None:
    """Draft acceptance in the measured window (None: nothing was proposed)."""
    steps, drafts = info.get("spec_steps", 0), info.get("spec_draft_tokens", 0)
    if not drafts:
        return None
    accepted = info["spec_accepted_tokens"]
    return {"verifications": steps, "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts,
            # Tokens a verification gives: its accepted drafts plus the target's own token.
            "mean_tokens_per_verification": (accepted + steps) / steps}


def _speculation_line(spec: dict | None) -> str:
    if not spec:
        return "off (or nothing proposed)"
    return (f"{100 * spec['acceptance_rate']:.1f}% of {spec['draft_tokens']} drafts accepted; "
            f"{spec['mean_tokens_per_verification']:.2f} tokens per verification")
