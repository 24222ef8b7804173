"""`jaxserve kv_budget`: analytic KV-cache memory accounting (docs/design.md, "KV memory
accounting").

Architecture from --num_layers/--num_kv_heads/--head_dim/--dtype_bytes (or --kv_cache_dtype,
which counts an int8 pool's scales too), or from --model (explicit flags override the model's
values). Lengths from --lengths (comma list) and/or --uniform_max=M
(lengths uniform on 1..M, analysed exactly). Prints a table, or JSON with --json; --plot_dir writes
kv_gib_vs_context.{png,svg,csv} and tail_waste_vs_page_size.{png,svg,csv}.

  jaxserve kv_budget --num_layers=32 --num_kv_heads=8 --head_dim=128 --dtype_bytes=2 \\
      --lengths=37,91,128,201,511 --reserve=512 --page_sizes=16,32
"""

from __future__ import annotations

import dataclasses
import json
import sys

from absl import flags

from jaxserve.config import (DRAFT_QUANTIZATIONS, KV_SCALAR_BYTES, MAX_SPECULATIVE_TOKENS,
                             QUANTIZATIONS, SPECULATIVE_METHODS, kv_slot_bytes)
from jaxserve.tools import architectures
from jaxserve.tools import kv_budget as kvb

FLAGS = flags.FLAGS

flags.DEFINE_integer("num_layers", None, "Decoder layers L.")
flags.DEFINE_integer("num_kv_heads", None, "KV heads H_kv (grouped-query attention: fewer than "
                     "query heads).")
flags.DEFINE_integer("head_dim", None, "Head dimension d_head.")
flags.DEFINE_integer("dtype_bytes", None, "Bytes per KV scalar (4 float32, the engine default; "
                     "2 bfloat16/float16; 1 int8).")
flags.DEFINE_enum("kv_cache_dtype", None, sorted(KV_SCALAR_BYTES),
                  "The engine's KV pool dtype (instead of --dtype_bytes): int8 adds a float32 "
                  "scale per token and KV head.")
flags.DEFINE_string("model", None, "Model name or path; its config gives L, H_kv and d_head "
                    "(loaded with jaxserve.weights.load_model only when this flag is given).")
flags.DEFINE_list("lengths", None, "Comma list of retained lengths (tokens per request).")
flags.DEFINE_integer("uniform_max", None, "Analyse lengths uniform on 1..M exactly (no sampling).")
flags.DEFINE_list("page_sizes", [str(b) for b in kvb.DEFAULT_PAGE_SIZES],
                  "Comma list of page sizes B (slots per page).")
flags.DEFINE_integer("reserve", None, "Fixed reservation (slots per request) to compare with; "
                     "defaults to the longest length / to M for --uniform_max.")
flags.DEFINE_integer("num_speculative_tokens", 0, "Speculative decoding's drafts per step (k): "
                     "the lookahead pages a verification holds before rolling back.")
flags.DEFINE_integer("memory_budget_bytes", None, "Print the engine's memory plan for --model "
                     "under this budget per device (weights, measured activation peak and "
                     "runtime, KV pool) instead of the analysis: loads and compiles, serves "
                     "nothing.")
flags.DEFINE_enum("speculative_method", None, SPECULATIVE_METHODS, "The plan's speculative "
                  "decoding (with --num_speculative_tokens; default ngram): draft adds the draft "
                  "model's weights and KV pool to the plan.")
flags.DEFINE_string("speculative_model", None, "The plan's draft model (default: the target's "
                    "own weights).")
flags.DEFINE_enum("speculative_quantization", "none", DRAFT_QUANTIZATIONS,
                  "The plan's draft weights: none or int8.")
flags.DEFINE_enum("quantization", None, QUANTIZATIONS, "The plan's weights (default: none).")
flags.DEFINE_integer("max_num_seqs", None, "The plan's engine option (default: the engine's).")
flags.DEFINE_integer("max_num_batched_tokens", None, "The plan's engine option (default: the "
                     "engine's): it fixes the activation peak.")
flags.DEFINE_integer("tensor_parallel_size", 1, "Devices the KV heads are sharded over: also "
                     "report per-device KV bytes (heads repeated when fewer than devices).")
flags.DEFINE_bool("enable_expert_parallel", False, "The plan's engine option: a mixture of "
                  "experts' experts spread over the --tensor_parallel_size devices (the plan's "
                  "weights per device hold num_experts / tp of them).")
flags.DEFINE_integer("sliding_window", None, "Every layer attends only the last W positions "
                     "(Mistral): also report the pages a request holds once pages wholly "
                     "before the window are released (default with --model: its window when "
                     "every layer has one).")
flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
flags.DEFINE_string("plot_dir", None, "Write the two plots (PNG, SVG, CSV) into this directory.")
flags.DEFINE_string("architectures", None, "JSON file of named architectures for the "
                    "GiB-vs-context plot (default: configs/architectures.json).")
flags.DEFINE_integer("plot_max_context", 131072, "Longest context in the GiB-vs-context plot.")

EXIT_USAGE = 2
LAYER_WINDOWS: list = []  # --model's window per layer (None: full): its layer groups


class _Usage(Exception):
    pass


def _fail(msg: str, code: int = EXIT_USAGE) -> None:
    print(f"jaxserve kv_budget: error: {msg}", file=sys.stderr)
    print("(`jaxserve kv_budget --helpfull` lists the flags)", file=sys.stderr)
    sys.exit(code)


def _int_list(values: list[str] | None, name: str) -> list[int] | None:
    if values is None:
        return None
    out = []
    for v in values:
        try:
            out.append(int(v.strip()))
        except ValueError:
            raise _Usage(f"--{name} must be a comma list of integers, got {v!r}") from None
    if not out:
        raise _Usage(f"--{name} is empty")
    return out


def _positive(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise _Usage(f"--{name} must be >= 1, got {value}")


def _architecture() -> kvb.KVArchitecture:
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
        _positive(getattr(FLAGS, name), name)
    fields = {"num_layers": FLAGS.num_layers, "num_kv_heads": FLAGS.num_kv_heads,
              "head_dim": FLAGS.head_dim}
    name = "flags"
    if FLAGS.model:
        try:
            from jaxserve import weights  # imported only for --model
            config = weights.load_model(FLAGS.model).config
        except ImportError as e:
            raise _Usage(f"--model needs jaxserve.weights, which failed to import ({e}); "
                         "give --num_layers, --num_kv_heads and --head_dim instead") from None
        except Exception as e:  # noqa: BLE001 - report any loader failure without a traceback
            raise _Usage(f"could not load model {FLAGS.model!r}: {type(e).__name__}: {e}") from None
        for k in fields:
            if fields[k] is None:
                fields[k] = int(getattr(config, k))
        if FLAGS.sliding_window is None:
            FLAGS.sliding_window = config.kv_window
        LAYER_WINDOWS[:] = [config.layer_window(i) for i in range(config.num_layers)]
        name = f"model {FLAGS.model}"
    missing = [f"--{k}" for k, v in fields.items() if v is None]
    if missing:
        raise _Usage(f"missing architecture flag(s) {', '.join(missing)} "
                     "(or give --model to read them from a model's config)")
    if FLAGS.kv_cache_dtype is not None and FLAGS.dtype_bytes is not None:
        raise _Usage("give --dtype_bytes or --kv_cache_dtype, not both")
    if FLAGS.kv_cache_dtype is not None:
        dtype_bytes, scale_bytes = kv_slot_bytes(FLAGS.kv_cache_dtype)
    else:
        dtype_bytes = kvb.DEFAULT_DTYPE_BYTES if FLAGS.dtype_bytes is None else FLAGS.dtype_bytes
        scale_bytes = 0
    return kvb.KVArchitecture(dtype_bytes=dtype_bytes, scale_bytes=scale_bytes, name=name,
                              **fields)


def _human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:g} B"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _render(result: dict) -> str:
    a = result["architecture"]
    scales = f" + {a['scale_bytes']} scale bytes" if a["scale_bytes"] else ""
    out = [f"KV accounting ({a['name']}): {a['num_layers']} layers x {a['num_kv_heads']} KV heads "
           f"x (head dim {a['head_dim']} x {a['dtype_bytes']} bytes{scales}) x 2 (K and V)",
           f"bytes per token: {result['bytes_per_token']} ({_human_bytes(result['bytes_per_token'])})"]
    if "per_device" in result:
        d = result["per_device"]
        repeated = (f", {d['repeated_kv_heads']} repeated copies counted"
                    if d["repeated_kv_heads"] else "")
        out.append(f"per device at tensor_parallel_size {d['tensor_parallel_size']}: "
                   f"{d['kv_heads_per_device']} KV head(s){repeated}; "
                   f"{d['bytes_per_token']} bytes per token "
                   f"({_human_bytes(d['bytes_per_token'])})")
    if "lengths" in result:
        s = result["lengths"]
        ls = s["lengths"]
        shown = ", ".join(map(str, ls[:12])) + (", ..." if len(ls) > 12 else "")
        out += ["", f"lengths: {shown}  ({s['num_requests']} requests, {s['useful_slots']} useful "
                f"slots, KV {s['kv_bytes']} bytes = {_human_bytes(s['kv_bytes'])}; "
                f"reserve {s['reserve']} from {s['reserve_source']})"]
        if "kv_bytes_per_device" in s:
            out.append(f"KV per device: {s['kv_bytes_per_device']} bytes = "
                       f"{_human_bytes(s['kv_bytes_per_device'])}")
        rows = []
        for p in s["policies"]:
            per = p["tail_waste_per_request"]
            per_s = ",".join(map(str, per[:8])) + (",..." if len(per) > 8 else "")
            rows.append([p["label"], "-" if p["pages"] is None else p["pages"],
                         p["allocated_slots"], p["useful_slots"], p["total_tail_waste"], per_s,
                         f"{p['mean_tail_waste']:.4g}", f"{p['utilisation_percent']:.2f}%",
                         _human_bytes(p["allocated_bytes"])])
        out.append(_table(rows, ["policy", "pages", "allocated", "useful", "tail waste",
                                 "per request", "mean", "utilisation", "KV allocated"]))
        for la in s.get("speculative_lookahead", []):
            out.append(f"speculative lookahead of {la['lookahead']}, pages of {la['page_size']}: "
                       f"peak {la['peak_pages']} pages (plain {la['pages']}; "
                       f"+{_human_bytes(la['extra_bytes'])} during a verification)")
        for lg in s.get("layer_groups", []):
            groups = " + ".join(f"{g['pages']} ({'full' if g['window'] is None else g['window']})"
                                for g in lg["groups"])
            out.append(f"layer groups of {lg['layers_per_page']} layers, pages of "
                       f"{lg['page_size']}, {lg['length']} tokens: {groups} = {lg['pages']} "
                       f"pages, {_human_bytes(lg['bytes'])} (every page kept: "
                       f"{_human_bytes(lg['every_page_kept_bytes'])})")
        for sw in s.get("sliding_window", []):
            out.append(f"sliding window of {sw['window']}, pages of {sw['page_size']}: "
                       f"{sw['window_pages']} pages held (full length {sw['pages']}; "
                       f"{_human_bytes(sw['window_bytes'])})")
    if "uniform" in result:
        u = result["uniform"]
        out += ["", f"{u['distribution']} (exact; mean length {u['mean_length_exact']}; "
                f"reserve {u['reserve']} from {u['reserve_source']})"]
        rows = [[p["label"], p["mean_tail_waste_exact"], f"{p['mean_tail_waste']:.6g}",
                 f"{p['mean_allocated_slots']:.6g}", f"{p['utilisation_percent']:.2f}%"]
                for p in u["policies"]]
        out.append(_table(rows, ["policy", "mean tail waste", "(decimal)", "mean allocated",
                                 "utilisation"]))
    if "plots" in result:
        out += ["", "plots:"] + [f"  {p}" for group in result["plots"].values()
                                 for p in group.values()]
    return "\n".join(out)


def _plot(result: dict, arch: kvb.KVArchitecture, lengths, uniform_max, page_sizes,
          reserve) -> dict:
    from jaxserve.tools import plots  # matplotlib only when plotting

    archs = architectures.load_architectures(FLAGS.architectures)
    shape = lambda a: (a.num_layers, a.num_kv_heads, a.head_dim, a.dtype_bytes,  # noqa: E731
                       a.scale_bytes)
    same = [i for i, a in enumerate(archs) if shape(a) == shape(arch)]
    if same:  # the run's architecture is already a named one: mark it, don't draw it twice
        i = same[0]
        archs[i] = dataclasses.replace(archs[i], name=f"{archs[i].name} = this run")
    else:
        label = arch.name[6:] if arch.name.startswith("model ") else "this run"
        archs.append(kvb.KVArchitecture(arch.num_layers, arch.num_kv_heads, arch.head_dim,
                                        arch.dtype_bytes, scale_bytes=arch.scale_bytes,
                                        name=f"{label}: L{arch.num_layers} H{arch.num_kv_heads} "
                                             f"d{arch.head_dim} {arch.dtype_bytes}B"))
    _positive(FLAGS.plot_max_context, "plot_max_context")
    contexts = [c for c in kvb.DEFAULT_CONTEXTS if c <= FLAGS.plot_max_context] or [
        FLAGS.plot_max_context]
    header, rows = kvb.gib_vs_context(archs, contexts)
    paths = {"kv_gib_vs_context": plots.plot_kv_gib_vs_context(FLAGS.plot_dir, header, rows)}

    if uniform_max is not None:
        top, dist = uniform_max, f"lengths uniform on 1..{uniform_max}"
        r = reserve if reserve is not None else uniform_max
        src = {"uniform_max": uniform_max}
    else:
        top, dist = max(lengths), f"{len(lengths)} given lengths"
        r = reserve if reserve is not None else max(lengths)
        src = {"lengths": lengths}
    # powers of two up to the first one >= the longest length, plus the requested page sizes
    sweep = sorted({2 ** k for k in range(0, max(top - 1, 1).bit_length() + 1)} | set(page_sizes))
    header, rows, ref = kvb.tail_waste_vs_page_size(sweep, reserve=r, **src)
    paths["tail_waste_vs_page_size"] = plots.plot_tail_waste_vs_page_size(
        FLAGS.plot_dir, header, rows, ref, reserve=r, distribution=dist, highlight=page_sizes)
    return paths


def _memory_plan() -> dict:
    """The engine's plan under --memory_budget_bytes, as LLMEngine makes it at start-up."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    if not FLAGS.model:
        raise _Usage("--memory_budget_bytes plans for a model: give --model")
    page_sizes = _int_list(FLAGS.page_sizes, "page_sizes")
    if FLAGS["page_sizes"].present and len(page_sizes) != 1:
        raise _Usage("the memory plan takes one page size: give --page_sizes=B")
    options = {"page_size": page_sizes[0] if FLAGS["page_sizes"].present else None,
               "kv_cache_dtype": FLAGS.kv_cache_dtype, "max_num_seqs": FLAGS.max_num_seqs,
               "max_num_batched_tokens": FLAGS.max_num_batched_tokens,
               "tensor_parallel_size": FLAGS.tensor_parallel_size,
               "enable_expert_parallel": FLAGS.enable_expert_parallel,
               "quantization": FLAGS.quantization}
    if FLAGS.num_speculative_tokens or FLAGS.speculative_method:
        method = FLAGS.speculative_method or "ngram"
        spec = {"method": method}
        if FLAGS.num_speculative_tokens:
            spec["num_speculative_tokens"] = FLAGS.num_speculative_tokens
        if method == "draft":
            spec.update(model=FLAGS.speculative_model, quantization=FLAGS.speculative_quantization)
        options["speculative_config"] = spec
    config = EngineConfig.from_options(model=FLAGS.model,
                                       memory_budget_bytes=FLAGS.memory_budget_bytes,
                                       **{k: v for k, v in options.items() if v is not None})
    engine = LLMEngine(config)
    summary = engine.memory_plan.describe(engine.max_model_len)
    draft = {k: v for k, v in engine.speculator.stats().items() if k.startswith("draft_")}
    if "draft_weight_bytes" in draft:
        summary += (f"; the weights include the draft model's {draft['draft_weight_bytes']} "
                    f"bytes, and each page its draft KV")
    return {"memory_plan": engine.memory_plan.as_dict(), "max_model_len": engine.max_model_len,
            "summary": summary, **draft}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected positional argument(s) {argv[1:]}")
    if FLAGS.memory_budget_bytes is not None:
        try:
            plan = _memory_plan()
        except (_Usage, ValueError) as e:
            _fail(str(e))
        print(json.dumps(plan, indent=2) if FLAGS.json else plan["summary"])
        return
    try:
        arch = _architecture()
        lengths = _int_list(FLAGS.lengths, "lengths")
        page_sizes = _int_list(FLAGS.page_sizes, "page_sizes")
        for i, t in enumerate(lengths or []):
            if t < 1:
                raise _Usage(f"--lengths values must be >= 1, got {t} at position {i}")
        for b in page_sizes:
            if b < 1:
                raise _Usage(f"--page_sizes values must be >= 1, got {b}")
        _positive(FLAGS.uniform_max, "uniform_max")
        _positive(FLAGS.reserve, "reserve")
        _positive(FLAGS.tensor_parallel_size, "tensor_parallel_size")
        if lengths is None and FLAGS.uniform_max is None:
            raise _Usage("give --lengths=T1,T2,... or --uniform_max=M (or both)")
        if FLAGS.reserve is not None:
            if lengths is not None and max(lengths) > FLAGS.reserve:
                raise _Usage(f"--lengths has {sum(t > FLAGS.reserve for t in lengths)} length(s) "
                             f"longer than --reserve={FLAGS.reserve} (longest {max(lengths)})")
            if FLAGS.uniform_max is not None and FLAGS.uniform_max > FLAGS.reserve:
                raise _Usage(f"--uniform_max={FLAGS.uniform_max} is longer than "
                             f"--reserve={FLAGS.reserve}")
        if not 0 <= FLAGS.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise _Usage(f"--num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got "
                         f"{FLAGS.num_speculative_tokens}")
        result = kvb.analyse(arch, lengths=lengths, uniform_max=FLAGS.uniform_max,
                             page_sizes=page_sizes, reserve=FLAGS.reserve,
                             lookahead=FLAGS.num_speculative_tokens,
                             tensor_parallel_size=FLAGS.tensor_parallel_size,
                             window=FLAGS.sliding_window, layer_windows=LAYER_WINDOWS or None)
        if FLAGS.plot_dir:
            result["plots"] = _plot(result, arch, lengths, FLAGS.uniform_max, page_sizes,
                                    FLAGS.reserve)
    except (_Usage, ValueError) as e:
        _fail(str(e))
    if FLAGS.json:
        print(json.dumps(result, indent=2))
    else:
        print(_render(result))
