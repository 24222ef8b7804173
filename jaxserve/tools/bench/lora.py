"""The LoRA workload of `jaxserve bench` (--lora_modules): the same workload on the base engine
and on the LoRA engine, the requests over the adapters in turn, at each stream count
(max_num_seqs = num_prompts = streams); output tokens/s, TPOT and the LoRA / base ratio."""

from __future__ import annotations

import os


def compare_lora(bench, options: dict, workload, streams_list: list[int]) -> dict:
    """bench: cli/bench.py's Bench over the base options (one loaded model for both)."""
    from jaxserve.core.lora import named_adapters

    loras = list(named_adapters(options["lora_modules"]))
    lora_options = dict(options, enable_lora=True)
    base_options = dict(options, enable_lora=False, lora_modules=())
    rows = []
    for streams in streams_list:
        # Every adapter once in the warm-up: the timed run places none for the first time.
        w = workload.replace(num_prompts=streams, num_warmup=max(workload.num_warmup, len(loras)))
        base, _ = bench.run(f"base, {streams} streams", dict(base_options, max_num_seqs=streams), w)
        lora, _ = bench.run(f"lora x{len(loras)}, {streams} streams",
                            dict(lora_options, max_num_seqs=streams), w, lora_requests=loras)
        rows.append({"streams": streams, "ratio": lora["output_throughput"]
                     / base["output_throughput"], "base": base, "lora": lora})
    return {"adapters": len(loras), "max_loras": options["max_loras"],
            "max_lora_rank": options["max_lora_rank"], "rows": rows,
            "load_average": list(os.getloadavg())}


def format_lora(rep: dict) -> str:
    lines = [f"LoRA ({rep['adapters']} adapters, max_loras {rep['max_loras']}, rank <= "
             f"{rep['max_lora_rank']}) against the base; load average "
             f"{', '.join(f'{x:.2f}' for x in rep['load_average'])}",
             f"{'streams':>8}{'base tok/s':>12}{'lora tok/s':>12}{'ratio':>8}"
             f"{'TPOT base':>11}{'TPOT lora':>11}"]
    for r in rep["rows"]:
        lines.append(f"{r['streams']:>8}{r['base']['output_throughput']:>12.1f}"
                     f"{r['lora']['output_throughput']:>12.1f}{r['ratio']:>8.2f}"
                     f"{r['base']['tpot_ms']['p50']:>9.1f}ms{r['lora']['tpot_ms']['p50']:>9.1f}ms")
    return "\n".join(lines)
