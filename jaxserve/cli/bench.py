"""`jaxserve bench`: a serving benchmark under a stated workload (docs/design.md, "Serving
evaluation protocol"), in-process against the engine or, with --url, against an OpenAI-compatible server.

  jaxserve bench --num_prompts=64 --request_rate=inf --input_len=128 --output_len=64 \\
      --json_out=bench.json --plot_dir=bench_plots --ablate=paging,scheduling
  jaxserve bench --workload=configs/bench_shared_prefix.json --ablate=prefix_caching
  jaxserve bench --url=http://127.0.0.1:8000 --num_prompts=32 --request_rate=4
  jaxserve bench --runner=pooling --model=DIR --compare_sentence_transformers
  jaxserve bench --lora_modules=a=DIR_A --lora_modules=b=DIR_B --max_loras=2 --output_len=64

Workload flags given explicitly override the --workload file. Prompts are seeded random token ids
(exact lengths); greedy and ignore_eos by default (exact output lengths). --seed seeds both the
workload and the engine. Each ablation runs the same workload with a fresh engine per variant
(baseline = the configuration from the flags) and prints one side-by-side table.

Embeddings workload (a pooling engine, --runner=pooling): --num_prompts inputs of --input_len
seeded token ids (64 x 512 unless given), embeddings/s and tokens/s, best of --repeats;
--compare_sentence_transformers runs the same token ids through sentence-transformers on --model
(a sentence-transformers directory) in the same run. Prefix caching is off (repeats would hit).

LoRA workload (--lora_modules name=path ...): the same workload on the base engine and on the
LoRA engine (enable_lora), requests over the adapters in turn, at each of --lora_streams
concurrent streams (max_num_seqs = num_prompts = streams): output tokens/s and TPOT of each and
the LoRA / base ratio. The warm-up takes every adapter once.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys

from absl import flags

from jaxserve.cli import engine_flags  # noqa: F401  (defines the engine flags)

FLAGS = flags.FLAGS
ABLATIONS = ("paging", "scheduling", "prefix_caching", "backend")

flags.DEFINE_enum("compile_warmup", "default", ["none", "default", "full"],
                  "Compile step shapes before the warm-up requests, so the measured window "
                  "holds no compilation: default = every shape of a packed backend (cpu), the "
                  "pure decode and prefill buckets of the others; full = every bucket "
                  "combination; none = compile on first use (the report then warns).")
flags.DEFINE_string("workload", None, "Workload JSON file (see configs/bench_*.json).")
flags.DEFINE_integer("num_prompts", 32, "Requests in the timed run.")
flags.DEFINE_string("request_rate", "inf", "Requests per second; inf = all at once; "
                    "sweep:R1,R2,... runs the workload at each rate and plots goodput and p99 "
                    "TTFT against the offered rate (needs an SLO; with --ablate=scheduling, "
                    "iteration and static on one plot).")
flags.DEFINE_enum("arrival", "poisson", ["poisson", "gamma"], "Arrival process at a finite rate.")
flags.DEFINE_float("burstiness", 1.0, "Gamma shape (1 = Poisson, < 1 burstier).")
flags.DEFINE_string("input_len", "64", "Prompt length: N, uniform:LO:HI, normal:MEAN:STD[:MAX], "
                    "list:A,B,...")
flags.DEFINE_string("output_len", "32", "Output length (same forms as --input_len).")
flags.DEFINE_integer("shared_prefix_len", 0, "Tokens of a prefix shared by each group.")
flags.DEFINE_integer("prefix_group_size", 1, "Requests per shared prefix.")
flags.DEFINE_bool("ignore_eos", True, "Generate exactly the output length.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
flags.DEFINE_integer("num_warmup", 2, "Untimed warm-up requests before the run.")
flags.DEFINE_string("json_out", None, "Write the report (and ablations) as JSON here.")
flags.DEFINE_string("plot_dir", None, "Write latency CDF, throughput and memory plots here.")
flags.DEFINE_float("slo_ttft_ms", None, "Goodput SLO on time to first token.")
flags.DEFINE_float("slo_tpot_ms", None, "Goodput SLO on time per output token.")
flags.DEFINE_list("ablate", [], f"Ablations: {','.join(ABLATIONS)} or all.")
flags.DEFINE_bool("force_pallas", False, "On CPU, make the backend ablation xla vs pallas "
                  "(interpret mode, very slow; uses a tiny workload) instead of cpu vs xla.")
flags.DEFINE_string("url", None, "Benchmark a running OpenAI-compatible server at this base URL.")
flags.DEFINE_string("served_model_name", None, "The `model` field sent to the server "
                    "(default: --model).")
flags.DEFINE_integer("vocab_size", 32000, "With --url: prompt token ids are drawn below this.")
flags.DEFINE_integer("server_pid", None, "With --url: sample this process's RSS.")
flags.DEFINE_bool("progress", False, "Show a progress bar.")
flags.DEFINE_bool("compare_sentence_transformers", False, "Embeddings workload: also embed the "
                  "same inputs with sentence-transformers on --model, in the same run.")
flags.DEFINE_integer("reference_batch_size", 16, "sentence-transformers' batch size.")
flags.DEFINE_integer("repeats", 2, "Embeddings workload: timed runs (the best is reported).")
flags.DEFINE_list("lora_streams", ["1", "32"], "LoRA workload: the concurrent stream counts.")

_WORKLOAD_FLAGS = {"num_prompts": "num_prompts", "request_rate": "request_rate",
                   "arrival": "arrival", "burstiness": "burstiness", "input_len": "input_len",
                   "output_len": "output_len", "shared_prefix_len": "shared_prefix_len",
                   "prefix_group_size": "prefix_group_size", "seed": "seed",
                   "ignore_eos": "ignore_eos", "temperature": "temperature",
                   "num_warmup": "num_warmup"}


class _Usage(Exception):
    pass


def workload_from_flags():
    from jaxserve.tools.bench.workload import WorkloadSpec

    base = WorkloadSpec.from_json(FLAGS.workload).to_dict() if FLAGS.workload else {}
    for flag, field in _WORKLOAD_FLAGS.items():
        if not FLAGS.workload or FLAGS[flag].present:
            base[field] = FLAGS[flag].value
    rates = sweep_rates()
    if rates:
        base["request_rate"] = rates[0]
    try:
        base["request_rate"] = float(base.get("request_rate", math.inf))
    except ValueError:
        raise _Usage(f"--request_rate must be a number or inf, got {base['request_rate']!r}")
    return WorkloadSpec.from_dict(base)


def sweep_rates() -> list[float] | None:
    """The rates of --request_rate=sweep:R1,R2,..., or None."""
    value = str(FLAGS.request_rate)
    if not value.startswith("sweep:"):
        return None
    try:
        rates = [float(r) for r in value[len("sweep:"):].split(",") if r.strip()]
    except ValueError:
        raise _Usage(f"--request_rate=sweep: takes numbers, got {value!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise _Usage(f"--request_rate=sweep: needs positive rates, got {value!r}")
    return sorted(rates)


def run_sweep(bench: "Bench", workload, rates: list[float], ablations: list[str]) -> dict:
    """Goodput and p99 TTFT of each variant at each offered rate."""
    if set(ablations) - {"scheduling"}:
        raise _Usage("a rate sweep compares --ablate=scheduling only")
    variants = ([("iteration", dict(bench.options, scheduling="iteration")),
                 ("static", dict(bench.options, scheduling="static"))]
                if ablations else [("baseline", bench.options)])
    rows = []
    for rate in rates:
        for label, options in variants:
            rep, _ = bench.run(f"{label} @ {rate:g} req/s", options,
                               workload.replace(request_rate=rate))
            rows.append([label, rate, rep["goodput"]["requests_per_s"],
                         rep["goodput"]["fraction"], rep["ttft_ms"]["p99"],
                         rep["request_throughput"], len(rep.get("warnings", []))])
    return {"header": ["variant", "offered_req_s", "goodput_req_s", "goodput_fraction",
                       "ttft_p99_ms", "completed_req_s", "warnings"], "rows": rows}


def format_sweep(sweep: dict, slo: tuple) -> str:
    lines = [f"Goodput under SLOs (TTFT <= {slo[0]} ms, TPOT <= {slo[1]} ms) by offered rate",
             f"{'variant':<12}{'offered':>10}{'goodput':>10}{'in SLO':>9}{'TTFT p99':>11}"]
    for label, rate, good, frac, p99, _, _ in sweep["rows"]:
        lines.append(f"{label:<12}{rate:>10g}{good:>10.3f}{100 * frac:>8.1f}%"
                     f"{(p99 or 0):>9.0f} ms")
    return "\n".join(lines)


def _write_sweep_plot(sweep: dict, slo: tuple, out_dir: str):
    from jaxserve.tools import plots

    fig, ax = plots.new_figure(width=8, height=4.5)
    ax2 = ax.twinx()
    for k, label in enumerate(dict.fromkeys(r[0] for r in sweep["rows"])):
        rows = [r for r in sweep["rows"] if r[0] == label]
        ax.plot([r[1] for r in rows], [r[2] for r in rows], "o-", color=f"C{k}",
                label=f"{label}: goodput")
        ax2.plot([r[1] for r in rows], [r[4] for r in rows], "s--", color=f"C{k}", alpha=0.6,
                 label=f"{label}: p99 TTFT")
    rates = sorted({r[1] for r in sweep["rows"]})
    ax.plot(rates, rates, ":", color="grey", label="offered")
    ax.set(xlabel="offered request rate (req/s)", ylabel="goodput (req/s)",
           title=f"Goodput under SLOs (TTFT <= {slo[0]} ms, TPOT <= {slo[1]} ms)")
    ax2.set_ylabel("p99 TTFT (ms)")
    lines = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize="small", loc="upper left")
    return plots.save_bundle(fig, out_dir, "bench_goodput_sweep", sweep["header"],
                             sweep["rows"])


def _ablations() -> list[str]:
    names = [a.strip() for a in FLAGS.ablate if a.strip()]
    if "all" in names:
        return list(ABLATIONS)
    bad = sorted(set(names) - set(ABLATIONS))
    if bad:
        raise _Usage(f"unknown ablation(s) {bad}; choose from {list(ABLATIONS)} or all")
    return names


class Bench:
    """Runs (engine options, workload) pairs with one loaded model; identical runs are reused."""

    def __init__(self, options: dict, slo: tuple):
        from jaxserve import backends
        from jaxserve.weights import load_model

        self.options = options
        self.loaded = load_model(options["model"],
                                 dtype=backends.resolve_dtype(options.get("dtype", "auto")))
        self.slo = slo
        self._cache: dict = {}

    def run(self, label: str, options: dict, workload, lora_requests: list | None = None):
        from jaxserve.config import EngineConfig
        from jaxserve.engine import LLMEngine
        from jaxserve.runtime.runner import release_compiled_steps
        from jaxserve.tools.bench import build_report, run_engine

        key = (json.dumps(options, sort_keys=True), json.dumps(workload.to_dict(), sort_keys=True),
               repr(lora_requests))
        if key in self._cache:
            rep, res = self._cache[key]
            return dict(rep, label=label), res
        print(f"[bench] {label}: {workload.describe()}", flush=True)
        engine = LLMEngine(EngineConfig.from_options(**options), self.loaded)
        if FLAGS.compile_warmup != "none":  # compile bucket shapes before the warm-up requests
            print(f"[bench] {label}: compile warm-up {engine.warmup(full=FLAGS.compile_warmup == 'full')}",
                  flush=True)
        res = run_engine(engine, workload, progress=FLAGS.progress, lora_requests=lora_requests)
        rep = build_report(res, workload=workload, slo_ttft_ms=self.slo[0], slo_tpot_ms=self.slo[1],
                           label=label)
        print(f"[bench] {label}: {rep['completed']} done, {rep['output_throughput']:.1f} out tok/s, "
              f"TTFT p50 {rep['ttft_ms']['p50']:.0f} ms, peak {rep['peak_kv_pages']} pages",
              flush=True)
        del engine
        gc.collect()
        release_compiled_steps()  # each variant's buckets compile their own shapes
        self._cache[key] = (rep, res)
        return rep, res

    def paging(self, workload):
        from jaxserve.config import EngineConfig

        longest = workload.max_total_len
        base = dict(self.options, max_model_len=longest)
        cfg = EngineConfig.from_options(**base)
        note = None
        var = dict(base, page_size=longest)
        page_size = cfg.cache.page_size
        if cfg.cache.kv_cache_bytes is None:  # same KV slots for both: convert the page budget
            pages = cfg.cache.resolve_num_pages(None, max_model_len=longest,
                                                max_num_seqs=cfg.scheduler.max_num_seqs)
            slots = (pages - 1) * page_size
            var["num_pages"] = 1 + max(1, slots // longest)
            note = (f"paging: same KV budget of {slots} slots: {pages - 1} pages of {page_size} "
                    f"vs {var['num_pages'] - 1} reserved slots of {longest} (max_model_len)")
        b, _ = self.run(f"page {page_size}", base, workload)
        v, _ = self.run(f"reserve {longest}/request", var, workload)
        return b, v, note

    def scheduling(self, workload):
        b, _ = self.run("iteration", dict(self.options, scheduling="iteration"), workload)
        v, _ = self.run("static", dict(self.options, scheduling="static"), workload)
        return b, v, None

    def prefix_caching(self, workload):
        note = None
        if not workload.shared_prefix_len or workload.prefix_group_size < 2:
            workload = workload.replace(shared_prefix_len=max(workload.input_len.max, 16),
                                        prefix_group_size=8)
            note = (f"prefix_caching: workload given shared prefixes of "
                    f"{workload.shared_prefix_len} tokens per 8 requests")
        options = dict(self.options)
        if options.get("max_model_len"):  # the added system prompt must fit the context too
            options["max_model_len"] = max(options["max_model_len"], workload.max_total_len)
        b, _ = self.run("prefix cache on", dict(options, enable_prefix_caching=True), workload)
        v, _ = self.run("prefix cache off", dict(options, enable_prefix_caching=False), workload)
        return b, v, note

    def backend(self, workload):
        """On CPU: the C++ kernels ("cpu") against plain XLA on the same workload (Pallas only
        with --force_pallas, on a tiny workload: interpret mode). Elsewhere: XLA vs Pallas."""
        import jax

        from jaxserve.backends.cpu import kernels as cpu_kernels

        if jax.default_backend() == "cpu" and not FLAGS.force_pallas:
            if not cpu_kernels.available():
                return None, None, (f"backend: skipped (CPU kernels unavailable: "
                                    f"{cpu_kernels.unavailable_reason()}; --force_pallas runs "
                                    "xla vs pallas on a tiny workload)")
            b, _ = self.run("cpu kernels", dict(self.options, attention_backend="cpu"), workload)
            v, _ = self.run("xla", dict(self.options, attention_backend="xla"), workload)
            return b, v, "backend: C++ CPU kernels (attention, matmuls, greedy argmax) vs plain XLA"
        note = None
        if jax.default_backend() not in ("cpu", "tpu", "gpu"):
            return None, None, (f"backend: skipped (no Pallas kernels for "
                                f"{jax.default_backend()})")
        if jax.default_backend() == "cpu":
            workload = workload.replace(num_prompts=min(workload.num_prompts, 4), input_len="16",
                                        output_len="4", shared_prefix_len=0, num_warmup=1)
            note = "backend: tiny workload (4 x 16+4 tokens) on CPU (Pallas in interpret mode)"
        b, _ = self.run("xla", dict(self.options, attention_backend="xla"), workload)
        v, _ = self.run("pallas", dict(self.options, attention_backend="pallas"), workload)
        return b, v, note


def _write_ablation_plot(pairs, out_dir):
    from jaxserve.tools import plots
    from jaxserve.tools.bench.report import MIB

    fig, ax1 = plots.new_figure(width=8, height=4.5)
    names, rows = [], []
    for i, (name, b, v) in enumerate(pairs):
        for j, rep in enumerate((b, v)):
            names.append(f"{name}\n{rep['label']}")
            rows.append([name, rep["label"], rep["output_throughput"], rep["ttft_ms"]["p50"],
                         rep.get("peak_kv_bytes", 0) / MIB])
    for k, r in enumerate(rows):
        ax1.bar(k, r[2], color=f"C{k // 2}", hatch="//" if k % 2 else None,
                edgecolor="black", linewidth=0.5)
        ax1.annotate(f"{r[2]:.1f}", (k, r[2]), ha="center", va="bottom", fontsize="x-small")
    ax1.set_xticks(list(range(len(rows))), names, fontsize="x-small")
    ax1.set(title="Ablations: output token throughput", ylabel="output tokens/s")
    return plots.save_bundle(fig, out_dir, "bench_ablations",
                             ["ablation", "variant", "output_tok_s", "ttft_p50_ms", "peak_kv_mib"],
                             rows)


def _given(flag: str, default):
    """The flag's value when given on the command line, else `default`."""
    return FLAGS[flag].value if FLAGS[flag].present else default


def run_embeddings_workload(options: dict) -> dict:
    """The embeddings workload of a pooling engine (see the module docstring)."""
    from jaxserve.llm import LLM
    from jaxserve.tools.bench.embeddings import format_embeddings, run_embeddings, token_inputs

    if FLAGS.url or _ablations() or sweep_rates() or FLAGS.workload:
        raise _Usage("the embeddings workload (--runner=pooling) runs in-process on "
                     "--num_prompts x --input_len, without --url, --ablate, a rate sweep or "
                     "a --workload file")
    if FLAGS.compare_sentence_transformers and not os.path.isfile(
            os.path.join(options["model"], "modules.json")):
        raise _Usage(f"--compare_sentence_transformers needs --model to be a "
                     f"sentence-transformers directory (modules.json), got {options['model']!r}")
    length = _given("input_len", "512")
    try:
        length = int(length)
    except ValueError:
        raise _Usage(f"the embeddings workload takes a fixed --input_len, got {length!r}") from None
    num = _given("num_prompts", 64)
    options = dict(options, enable_prefix_caching=False)
    llm = LLM(**options)
    inputs = token_inputs(num, length, llm.engine.model_config.vocab_size, FLAGS.seed or 0)
    print(f"[bench] embeddings: {num} inputs of {length} tokens", flush=True)
    rep = run_embeddings(llm, inputs, repeats=FLAGS.repeats,
                         reference_dir=options["model"] if FLAGS.compare_sentence_transformers
                         else None, reference_batch_size=FLAGS.reference_batch_size)
    print(format_embeddings(rep))
    return {"embeddings": rep}


def run_lora_workload(options: dict, workload) -> dict:
    """Base against LoRA engines on the same workload at each stream count."""
    from jaxserve.tools.bench.lora import compare_lora, format_lora

    if FLAGS.url or _ablations() or sweep_rates():
        raise _Usage("the LoRA workload (--lora_modules) runs in-process, without --url, "
                     "--ablate or a rate sweep")
    try:
        streams = [int(s) for s in FLAGS.lora_streams]
    except ValueError:
        raise _Usage(f"--lora_streams takes integers, got {FLAGS.lora_streams}") from None
    bench = Bench(dict(options, enable_lora=False, lora_modules=()),
                  (FLAGS.slo_ttft_ms, FLAGS.slo_tpot_ms))
    rep = compare_lora(bench, options, workload, streams)
    print("\n" + format_lora(rep))
    return {"lora": rep}


def main(argv):
    del argv
    from jaxserve.tools.bench import format_ablation, format_report

    try:
        options = engine_flags.engine_options()
        special = None
        if options.get("runner") == "pooling":
            special = run_embeddings_workload(options)
        elif options.get("lora_modules"):
            special = run_lora_workload(options, workload_from_flags())
        if special is not None:
            if FLAGS.json_out:
                with open(FLAGS.json_out, "w") as f:
                    json.dump(special, f, indent=1, default=float)
                print(f"\nwrote {FLAGS.json_out}")
            return 0
        workload = workload_from_flags()
        ablations = _ablations()
        if FLAGS.url and ablations:
            raise _Usage("--ablate runs the engine in-process; it cannot be combined with --url")
        slo = (FLAGS.slo_ttft_ms, FLAGS.slo_tpot_ms)
        out: dict = {}
        rates = sweep_rates()
        if rates:
            if FLAGS.url:
                raise _Usage("a rate sweep runs the engine in-process; not with --url")
            if slo == (None, None):
                raise _Usage("a rate sweep measures goodput under an SLO: give --slo_ttft_ms "
                             "and/or --slo_tpot_ms")
            bench = Bench(engine_flags.engine_options(), slo)
            out["sweep"] = run_sweep(bench, workload, rates, ablations)
            print(format_sweep(out["sweep"], slo))
            if FLAGS.plot_dir:
                paths = _write_sweep_plot(out["sweep"], slo, FLAGS.plot_dir)
                print(f"\nplot: {paths['png']}")
            if FLAGS.json_out:
                with open(FLAGS.json_out, "w") as f:
                    json.dump(out, f, indent=1, default=float)
                print(f"\nwrote {FLAGS.json_out}")
            return 0
        if FLAGS.url:
            from jaxserve.tools.bench import build_report, run_http

            res = run_http(FLAGS.url, workload, vocab_size=FLAGS.vocab_size,
                           model=FLAGS.served_model_name or FLAGS.model,
                           server_pid=FLAGS.server_pid)
            rep = build_report(res, workload=workload, slo_ttft_ms=slo[0], slo_tpot_ms=slo[1],
                               label=FLAGS.url)
        else:
            bench = Bench(engine_flags.engine_options(), slo)
            rep, res = bench.run("baseline", bench.options, workload)
        print(format_report(rep))
        out["report"] = rep
        if FLAGS.plot_dir:
            from jaxserve.tools.bench.report import write_plots

            paths = write_plots(rep, res, FLAGS.plot_dir)
            print(f"\nplots: {', '.join(p['png'] for p in paths.values())}")
        if ablations:
            pairs, notes = [], []
            for name in ablations:
                b, v, note = getattr(bench, name)(workload)
                if note:
                    notes.append(note)
                if b is not None:
                    pairs.append((name, b, v))
            print("\nAblations (latencies in ms; same workload and seed, fresh engine per row)")
            print(format_ablation(pairs, notes))
            out["ablations"] = [{"name": n, "baseline": b, "variant": v} for n, b, v in pairs]
            out["ablation_notes"] = notes
            if FLAGS.plot_dir and pairs:
                _write_ablation_plot(pairs, FLAGS.plot_dir)
        if FLAGS.json_out:
            with open(FLAGS.json_out, "w") as f:
                json.dump(out, f, indent=1, default=float)
            print(f"\nwrote {FLAGS.json_out}")
    except (_Usage, ValueError, OSError) as e:
        print(f"jaxserve bench: error: {e}", file=sys.stderr)
        return 2
    return 0
