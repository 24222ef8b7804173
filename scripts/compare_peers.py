"""Compare jaxserve with peers on the same offline workload, model and machine, in one run.

The workload (jaxserve.tools.bench.workload) fixes the prompts as token ids and each request's output
length; decoding is greedy with ignore_eos, so every system generates exactly the same number of
tokens. Peers:

- jaxserve: `LLM.generate` over all requests (iteration-level scheduling, paged KV).
- Hugging Face transformers `generate` with static batching: batches of --hf_batch_size requests
  in order, each batch run until its longest request ends (min_new_tokens = max_new_tokens =
  the batch's longest output; shorter requests are truncated to their own length afterwards, so
  their latency is the batch's). float32, torch.set_num_threads(--threads), same GGUF.
- llama.cpp (llama_cpp), single stream on the same GGUF (its first 4 requests), only where it is
  importable (scripts/install_llama_cpp.sh builds it; not a project dependency).

Latency: every request arrives at t = 0 (offline), so E2E = completion time; HF's per-batch first
token time is taken from a streamer. Greedy agreement (tokens equal to HF's before the first
difference) is reported as a check that both ran the same model.

  python scripts/compare_peers.py                       # 32 requests, prompt 64, output 32
  python scripts/compare_peers.py --num_prompts=256 --input_len=128 --output_len=128
  python scripts/compare_peers.py --num_prompts=256 --input_len=128 --output_len=uniform:16:256
  python scripts/compare_peers.py --concurrency_sweep=1,4,16,64 --plot_dir=docs/bench
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.tools.bench.report import greedy_agreement, summarize  # noqa: E402
from jaxserve.tools.bench.workload import WorkloadSpec  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_prompts", 32, "Requests.")
flags.DEFINE_string("input_len", "64", "Prompt length spec (N, uniform:LO:HI, ...).")
flags.DEFINE_string("output_len", "32", "Output length spec (max_tokens per request).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_integer("hf_batch_size", 32, "Static batch size for transformers.")
flags.DEFINE_integer("threads", 2, "torch threads.")
flags.DEFINE_integer("max_num_seqs", 64, "jaxserve max_num_seqs.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "jaxserve max_num_batched_tokens.")
flags.DEFINE_list("concurrency_sweep", [], "Concurrency levels: jaxserve max_num_seqs = HF batch "
                  "size = c, max(c, 4) requests each.")
flags.DEFINE_bool("skip_hf", False, "Run jaxserve only.")
flags.DEFINE_string("json_out", None, "Write the results as JSON.")
flags.DEFINE_string("plot_dir", None, "Write compare_concurrency.{png,svg,csv} here.")


def model_path() -> str:
    from jaxserve.weights.registry import default_model_path

    return default_model_path()


def _latency_summary(e2e: list[float], ttft: list[float], tokens: int, wall: float) -> dict:
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "requests_per_s": len(e2e) / wall,
            "e2e_ms": {k: v * 1000 for k, v in summarize(e2e).items() if k != "n"},
            "ttft_ms": {k: v * 1000 for k, v in summarize(ttft).items() if k != "n"}}


def run_jaxserve(loaded, requests, *, max_num_seqs: int) -> tuple[dict, list[list[int]]]:
    from jaxserve.config import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine import LLMEngine
    from jaxserve.llm import LLM

    llm = LLM.__new__(LLM)  # share the loaded weights: build the engine directly
    # Prefix caching off: the warm-up runs the same prompts, and cached prompt pages would be an
    # advantage the peers (which keep nothing between calls) do not get.
    llm.engine = LLMEngine(EngineConfig.from_options(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(
        FLAGS.max_num_batched_tokens, max_num_seqs), max_model_len=max(
        r.prompt_len + r.output_len for r in requests) + 1, enable_prefix_caching=False), loaded)
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in requests]
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    llm.generate(prompts[:2], params[:2])  # warm-up (compilations)
    llm.generate(prompts[:min(len(prompts), max_num_seqs)], params[:min(len(prompts), max_num_seqs)])
    t0 = time.monotonic()
    outs = llm.generate(prompts, params)
    wall = time.monotonic() - t0
    e2e = [o.metrics.finished_time - t0 for o in outs]
    ttft = [o.metrics.first_token_time - t0 for o in outs]
    tokens = [o.outputs[0].token_ids for o in outs]
    res = _latency_summary(e2e, ttft, sum(map(len, tokens)), wall)
    res["compilations"] = llm.engine.stats()["compilations"]
    return res, tokens


class _FirstToken:
    """A transformers streamer that records when the first generated token arrives."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.monotonic()

    def end(self):
        pass


def load_hf():
    import torch
    import transformers

    torch.set_num_threads(FLAGS.threads)
    directory, name = os.path.split(model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                              torch_dtype=torch.float32)
    model.eval()
    return model


def run_hf(model, requests, *, batch_size: int) -> tuple[dict, list[list[int]]]:
    import torch

    pad = model.config.pad_token_id
    pad = pad if pad is not None else (model.config.eos_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]

    def generate(batch, streamer=None):
        longest = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            ids[i, longest - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, longest - r.prompt_len:] = 1
        n = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=pad,
                                 streamer=streamer)
        return [out[i, longest:longest + r.output_len].tolist() for i, r in enumerate(batch)]

    generate(requests[:1])  # warm-up
    t0 = time.monotonic()
    e2e, ttft, tokens = [], [], []
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        streamer = _FirstToken()
        tokens += generate(batch, streamer)
        done = time.monotonic() - t0
        e2e += [done] * len(batch)
        ttft += [(streamer.first or time.monotonic()) - t0] * len(batch)
    wall = time.monotonic() - t0
    return _latency_summary(e2e, ttft, sum(map(len, tokens)), wall), tokens


def run_llama_cpp(requests) -> dict | str:
    try:
        import llama_cpp
    except ImportError:
        return ("llama_cpp is not importable here: llama.cpp skipped "
                "(scripts/install_llama_cpp.sh builds it)")
    llm = llama_cpp.Llama(model_path=model_path(), n_ctx=4096, n_threads=FLAGS.threads,
                          logits_all=False, verbose=False)
    eos = llm.token_eos()
    ban = llama_cpp.LogitsProcessorList([lambda _ids, logits: _ban(logits, eos)])
    subset = requests[:min(len(requests), 4)]
    t0 = time.monotonic()
    e2e, ttft, n_tok = [], [], 0
    for r in subset:  # single stream: one request at a time
        start = time.monotonic()
        first = None
        for _chunk in llm.create_completion(list(r.prompt_token_ids), max_tokens=r.output_len,
                                            temperature=0.0, stream=True,
                                            logits_processor=ban):
            first = first or time.monotonic()
            n_tok += 1
        e2e.append(time.monotonic() - start)
        ttft.append((first or time.monotonic()) - start)
    res = _latency_summary(e2e, ttft, n_tok, time.monotonic() - t0)
    res["requests"] = len(subset)
    return res


def _ban(logits, token):
    logits[token] = -float("inf")
    return logits


def _row(name, r) -> str:
    return (f"{name:<28}{r['output_tok_s']:>10.1f}{r['requests_per_s']:>9.2f}"
            f"{r['ttft_ms']['mean']:>11.0f}{r['e2e_ms']['mean']:>11.0f}{r['e2e_ms']['p50']:>11.0f}"
            f"{r['e2e_ms']['p99']:>11.0f}{r['wall_s']:>9.1f}")


def main(argv):
    del argv
    from jaxserve.weights import load_model

    spec = WorkloadSpec(num_prompts=FLAGS.num_prompts, input_len=FLAGS.input_len,
                        output_len=FLAGS.output_len, seed=FLAGS.seed, num_warmup=0)
    loaded = load_model(model_path())
    requests = spec.generate(loaded.config.vocab_size)
    print(f"workload: {spec.describe()}")
    print(f"machine: {os.cpu_count()} CPU cores, torch threads {FLAGS.threads}, float32, greedy")
    out: dict = {"workload": spec.to_dict(), "hf_batch_size": FLAGS.hf_batch_size}
    js, js_tokens = run_jaxserve(loaded, requests, max_num_seqs=FLAGS.max_num_seqs)
    out["jaxserve"] = js
    hf_model = None
    if not FLAGS.skip_hf:
        hf_model = load_hf()
        hf, hf_tokens = run_hf(hf_model, requests, batch_size=FLAGS.hf_batch_size)
        out["hf"] = hf
        out["agreement_with_hf"] = greedy_agreement(js_tokens, hf_tokens)
        out["ratios_jaxserve_over_hf"] = {
            "output_throughput": js["output_tok_s"] / hf["output_tok_s"],
            "mean_ttft": js["ttft_ms"]["mean"] / hf["ttft_ms"]["mean"],
            "mean_e2e": js["e2e_ms"]["mean"] / hf["e2e_ms"]["mean"],
            "p50_e2e": js["e2e_ms"]["p50"] / hf["e2e_ms"]["p50"],
            "p99_e2e": js["e2e_ms"]["p99"] / hf["e2e_ms"]["p99"]}
    lc = run_llama_cpp(requests)
    out["llama_cpp"] = lc

    head = (f"{'system':<28}{'out tok/s':>10}{'req/s':>9}{'TTFT mean':>11}{'E2E mean':>11}"
            f"{'E2E p50':>11}{'E2E p99':>11}{'wall s':>9}")
    print("\n" + head + "\n" + "-" * len(head))
    print(_row(f"jaxserve (max_num_seqs {FLAGS.max_num_seqs})", js))
    if "hf" in out:
        print(_row(f"transformers (batch {FLAGS.hf_batch_size})", out["hf"]))
        r = out["ratios_jaxserve_over_hf"]
        print(f"jaxserve / transformers: throughput x{r['output_throughput']:.2f}, mean TTFT "
              f"x{r['mean_ttft']:.2f}, mean E2E x{r['mean_e2e']:.2f}, p99 E2E x{r['p99_e2e']:.2f}")
        a = out["agreement_with_hf"]
        print(f"greedy agreement: {a['identical_requests']}/{a['requests']} identical, mean "
              f"matching prefix {a['mean_matching_prefix']:.1f} tokens")
    if isinstance(lc, dict):
        print(_row(f"llama.cpp (single stream, {lc['requests']} req)", lc))
    else:
        print(f"note: {lc}")

    if FLAGS.concurrency_sweep:
        levels = [int(c) for c in FLAGS.concurrency_sweep]
        sweep = []
        print(f"\n{'concurrency':>11}{'jaxserve tok/s':>16}{'HF tok/s':>10}")
        for c in levels:
            reqs = WorkloadSpec(num_prompts=max(c, 4), input_len=FLAGS.input_len,
                                output_len=FLAGS.output_len, seed=FLAGS.seed,
                                num_warmup=0).generate(loaded.config.vocab_size)
            j, _ = run_jaxserve(loaded, reqs, max_num_seqs=c)
            h = run_hf(hf_model, reqs, batch_size=c)[0] if hf_model is not None else None
            sweep.append({"concurrency": c, "requests": len(reqs), "jaxserve": j, "hf": h})
            print(f"{c:>11}{j['output_tok_s']:>16.1f}"
                  f"{h['output_tok_s'] if h else float('nan'):>10.1f}", flush=True)
        out["concurrency_sweep"] = sweep
        if FLAGS.plot_dir:
            from jaxserve.tools import plots

            series = {"jaxserve": [s["jaxserve"]["output_tok_s"] for s in sweep]}
            if hf_model is not None:
                series["transformers (static batch = c)"] = [s["hf"]["output_tok_s"] for s in sweep]
            paths = plots.line_plot(
                FLAGS.plot_dir, "compare_concurrency", levels, series, logx=True,
                title=f"Output throughput vs concurrency (prompt {FLAGS.input_len}, output "
                      f"{FLAGS.output_len}; {os.cpu_count()}-core CPU, f32)",
                xlabel="concurrency c (max_num_seqs / batch size; max(c, 4) requests)",
                ylabel="output tokens/s")
            print(f"plot: {paths['png']}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
