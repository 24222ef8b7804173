"""How closely each weight format's greedy output follows the f32 model's: sixteen chat prompts,
greedy, up to --max_tokens each, one engine per format on the default model. Reports the outputs
identical to f32 and the tokens generated before each output's first difference.

  python scripts/quantization_agreement.py                 # int8, and bf16 where AMX allows
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_integer("max_tokens", 64, "Greedy tokens per prompt.")

QUESTIONS = (
    "What is the capital of France?", "Name three fruits.", "Write a haiku about the sea.",
    "Explain gravity to a child.", "What is 17 times 3?", "List the planets.",
    "How do I boil an egg?", "Translate 'good morning' into Spanish.", "What is photosynthesis?",
    "Give me a tip for learning to code.", "Why is the sky blue?", "Who wrote Hamlet?",
    "Describe a cat in one sentence.", "What is the largest ocean?", "Suggest a name for a dog.",
    "What does a CPU do?")


def greedy(loaded, prompts, quantization: str) -> list[list[int]]:
    from jaxserve.config import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_options(num_pages=256, max_num_seqs=len(prompts),
                                                 quantization=quantization), loaded)
    params = SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def main(argv):
    del argv
    from jaxserve.backends.cpu import kernels as cpu_kernels
    from jaxserve.tools.bench.report import greedy_agreement
    from jaxserve.weights import load_model

    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": q}]), add_special_tokens=False)} for q in QUESTIONS]
    reference = greedy(loaded, prompts, "none")
    total = sum(map(len, reference))
    formats = ["int8"] + (["bf16"] if cpu_kernels.amx_bf16_available() else [])
    print(f"{'format':<8}{'identical':>12}{'tokens before the first difference':>38}")
    for quantization in formats:
        a = greedy_agreement(reference, greedy(loaded, prompts, quantization))
        same, agreed = f"{a['identical_requests']}/{a['requests']}", a["matching_prefix_tokens"]
        print(f"{quantization:<8}{same:>12}"
              f"{f'{agreed}/{total} ({agreed / total:.0%})':>38}")


if __name__ == "__main__":
    app.run(main)
