"""What the engine runs (LoadConfig, requested): the model, its numerics, its kernels and the
engine's seed. "auto" values are resolved per device by the engine (config/resolved.py)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import check_choices, option

ATTENTION_BACKENDS = ("auto", "cpu", "xla", "pallas")
PALLAS_KERNELS = ("auto", "tpu", "gpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "bf16")
SCAN_LAYERS = ("auto", "on", "off")
# vLLM's names: logprobs of the model's logits, or of those the sampler drew from (after logit
# controls and temperature); *_logits return the logits themselves.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
RUNNERS = ("generate", "pooling")  # pooling: embeddings, scores, classes (engine/pooling.py)
POOLING_TYPES = ("auto", "last", "mean", "cls")
POOLING_NORMALIZE = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    model: str = option("smollm2-135m",
                        "Model name (smollm2-135m), GGUF file, HF or orbax directory.")
    # auto: bfloat16 on GPU and TPU (softmax statistics stay float32 inside the kernels),
    # float32 on CPU (jaxserve.backends.resolve_dtype).
    dtype: str = option("auto", "Weights, activations and KV dtype; auto: bfloat16 on GPU/TPU, "
                        "float32 on CPU.", choices=DTYPES)
    # "bf16": products summed in f32 on AMX tiles (CPUs with AMX-BF16, the "cpu" backend).
    quantization: str = option("none", "int8: weight-only, groups of 32 inputs; bf16: bfloat16 "
                               "weights and matmuls on AMX (CPU).", choices=QUANTIZATIONS)
    attention_backend: str = option(
        "auto", "auto: the Pallas kernels on TPU/GPU; on CPU the C++ kernels, else xla. pallas "
        "on a CPU interprets (tests and debugging).", choices=ATTENTION_BACKENDS)
    pallas_kernels: str = option("auto", "Pallas kernel family; auto: the device's own (tpu "
                                 "when interpreted on CPU).", choices=PALLAS_KERNELS)
    # jaxserve.backends.cpu.huge_pages collapses the weights' host memory.
    huge_pages: bool = option(True, "Back the weights with 2 MiB pages (CPU, Linux 6.1+).")
    seed: int = option(0, "Engine seed for unseeded requests.")
    # jaxserve/model/layer_scan.py; auto: config.resolved.resolve_scan_layers.
    scan_layers: str = option("auto", "Run the layers by lax.scan over their stacked weights "
                              "(one layer body compiled: faster compiles); auto: on for TPU "
                              "only (docs/serving.md).", choices=SCAN_LAYERS)
    # runtime/sampling.py; docs/rl.md.
    logprobs_mode: str = option("raw_logprobs", "Returned logprobs: raw_logprobs (the model's, "
                                "before logit controls and temperature), processed_logprobs "
                                "(of the distribution sampled), raw_logits, processed_logits.",
                                choices=LOGPROBS_MODES)
    # model/batch_invariant.py; docs/rl.md.
    batch_invariant: bool = option(False, "A request's tokens and logprobs bitwise the same "
                                   "whatever else is in its batch, its row, chunking and prefix "
                                   "hits (cpu and xla backends; slower).")

    # engine/pooling.py; docs/pooling.md. auto: the checkpoint's sentence-transformers modules.
    runner: str = option("generate", "generate: sample tokens; pooling: embeddings, scores and "
                         "classes from the same model (LLM.embed / classify / score, "
                         "/v1/embeddings).", choices=RUNNERS)
    pooling_type: str = option("auto", "Pooling runner: the hidden state pooled; auto: the "
                               "checkpoint's 1_Pooling/config.json, else last.",
                               choices=POOLING_TYPES)
    pooling_normalize: str = option("auto", "Pooling runner: L2-normalise embeddings; auto: "
                                    "when the checkpoint has a Normalize module, else on.",
                                    choices=POOLING_NORMALIZE)

    classifier_from_tokens: str | None = option(
        None, "Pooling runner: a causal LM scoring by its last token's logits of these tokens "
        "(a reranker such as Qwen3-Reranker: 'no,yes' scores sigmoid(yes - no)); one token: "
        "its logit.")

    def __post_init__(self):
        check_choices(self)
