"""Engine options as absl flags, named as EngineConfig fields; mapped onto it in one place."""

from __future__ import annotations

from absl import flags

from jaxserve.config import (ATTENTION_BACKENDS, DRAFT_QUANTIZATIONS, DTYPES, KV_CACHE_DTYPES,
                             PALLAS_KERNELS, PRIORITY_POLICIES, QUANTIZATIONS, SCHEDULING_POLICIES,
                             SPECULATIVE_METHODS, EngineConfig, SpeculativeConfig)

_D = EngineConfig()
flags.DEFINE_string("model", _D.model, "Model name (smollm2-135m), GGUF file, HF or orbax directory.")
flags.DEFINE_enum("dtype", _D.dtype, DTYPES,
                  "Weights, activations and KV dtype; auto: bfloat16 on GPU/TPU, float32 on CPU.")
flags.DEFINE_enum("kv_cache_dtype", _D.kv_cache_dtype, KV_CACHE_DTYPES,
                  "KV pages; auto: as --dtype. int8: a float32 scale per token and KV head.")
flags.DEFINE_enum("quantization", _D.quantization, QUANTIZATIONS,
                  "int8: weight-only, groups of 32 inputs; bf16: bfloat16 weights and matmuls "
                  "on AMX (CPU).")
flags.DEFINE_enum("attention_backend", _D.attention_backend, ATTENTION_BACKENDS,
                  "auto: the Pallas kernels on TPU/GPU; on CPU the C++ kernels, else xla. "
                  "pallas on a CPU interprets (tests and debugging).")
flags.DEFINE_enum("pallas_kernels", _D.pallas_kernels, PALLAS_KERNELS,
                  "Pallas kernel family; auto: the device's own (tpu when interpreted on CPU).")
flags.DEFINE_integer("page_size", _D.page_size, "KV slots per page.")
flags.DEFINE_integer("memory_budget_bytes", None,
                     "The engine's memory per device (under tensor or data parallelism, each "
                     "device's): weights, the largest step's activations and the runtime are "
                     "measured at start, the KV pool gets the rest (logged).")
flags.DEFINE_float("memory_utilization", None,
                   "The same as a fraction of each device's memory (its allocator's limit; on "
                   "CPU, of RAM). Default: 0.9 on GPU/TPU; on CPU the pool is sized by "
                   "--num_pages or its default.")
flags.DEFINE_integer("num_pages", None, "KV pages in the pool, scratch page 0 included "
                     "(overrides a memory budget).")
flags.DEFINE_integer("kv_cache_bytes", None, "KV pool bytes (instead of num_pages; overrides a "
                     "memory budget).")
flags.DEFINE_integer("max_model_len", None, "Longest prompt + output; default: the model's context.")
flags.DEFINE_integer("max_num_seqs", _D.max_num_seqs, "Most sequences per step.")
flags.DEFINE_integer("max_num_batched_tokens", _D.max_num_batched_tokens, "Most tokens per step.")
flags.DEFINE_bool("enable_prefix_caching", _D.enable_prefix_caching, "Share full prompt pages.")
flags.DEFINE_bool("enable_chunked_prefill", _D.enable_chunked_prefill, "Split long prompts.")
flags.DEFINE_integer("prefill_keys_per_token", None,
                     "A prefill chunk's token at context c counts 1 + c / this against "
                     "--max_num_batched_tokens (deep chunks are shorter); default: from the "
                     "model and attention backend; 0: tokens alone count.")
flags.DEFINE_enum("scheduling", _D.scheduling, SCHEDULING_POLICIES,
                  "iteration: continuous batching; static: request-level batching (ablation).")
flags.DEFINE_enum("scheduling_policy", _D.scheduling_policy, PRIORITY_POLICIES, "Queue order.")
flags.DEFINE_bool("async_scheduling", _D.async_scheduling,
                  "Launch the next decode step before reading back this one's tokens.")
flags.DEFINE_bool("huge_pages", _D.huge_pages,
                  "Back the weights with 2 MiB pages (CPU, Linux 6.1+).")
flags.DEFINE_float("watermark", _D.watermark, "Fraction of pages kept free at admission.")
flags.DEFINE_string("cache_salt", None, "Prefix-cache salt (isolates tenants).")
flags.DEFINE_integer("seed", _D.seed, "Engine seed for unseeded requests.")
flags.DEFINE_integer("max_waiting", None, "Refuse new requests beyond this many waiting.")
flags.DEFINE_integer("tensor_parallel_size", _D.tensor_parallel_size,
                     "Devices each replica's weights and KV heads are sharded over.")
flags.DEFINE_integer("data_parallel_size", _D.data_parallel_size,
                     "Engine replicas, each with its own scheduler, KV pool and devices.")
flags.DEFINE_string("coordinator_address", None,
                    "host:port of process 0, to join several processes (hosts) as one engine.")
flags.DEFINE_integer("num_processes", _D.num_processes, "Processes joined as one engine.")
flags.DEFINE_integer("process_id", _D.process_id,
                     "This process's index; 0 schedules and serves, the others follow it.")
flags.DEFINE_integer("distributed_timeout_s", _D.distributed_timeout_s,
                     "Seconds to wait for every process to join; a peer silent for a sixth of "
                     "this ends the run with an error.")

_S = SpeculativeConfig()
flags.DEFINE_enum("speculative_method", None, SPECULATIVE_METHODS,
                  "Speculative decoding (off unless this or --num_speculative_tokens is given); "
                  "ngram: prompt lookup; draft: a draft model (--speculative_model).")
flags.DEFINE_integer("num_speculative_tokens", None,
                     f"Drafts per sequence and step, 1..16 (default {_S.num_speculative_tokens}).")
flags.DEFINE_integer("prompt_lookup_min", _S.prompt_lookup_min, "Shortest n-gram matched (ngram).")
flags.DEFINE_integer("prompt_lookup_max", _S.prompt_lookup_max, "Longest n-gram matched (ngram).")
flags.DEFINE_string("speculative_model", None,
                    "Draft model (method draft) sharing the target's tokenizer; default: the "
                    "target's own weights (self-speculation, with --speculative_quantization=int8).")
flags.DEFINE_enum("speculative_quantization", _S.quantization, DRAFT_QUANTIZATIONS,
                  "The draft model's weights (method draft).")
flags.DEFINE_bool("speculative_adaptive", _S.adaptive,
                  "Choose drafts per step from measured step costs (off: always k).")

FLAGS = flags.FLAGS
_NAMES = ("model", "dtype", "kv_cache_dtype", "quantization", "attention_backend", "pallas_kernels",
          "page_size", "memory_budget_bytes", "memory_utilization", "num_pages", "kv_cache_bytes", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
          "enable_prefix_caching", "enable_chunked_prefill", "prefill_keys_per_token",
          "scheduling", "scheduling_policy",
          "async_scheduling", "huge_pages", "watermark", "cache_salt", "seed", "max_waiting",
          "tensor_parallel_size", "data_parallel_size", "coordinator_address", "num_processes",
          "process_id", "distributed_timeout_s")


def engine_options() -> dict:
    options = {name: FLAGS[name].value for name in _NAMES}
    if FLAGS.speculative_method is not None or FLAGS.num_speculative_tokens is not None:
        spec = {"method": FLAGS.speculative_method or _S.method,
                "prompt_lookup_min": FLAGS.prompt_lookup_min,
                "prompt_lookup_max": FLAGS.prompt_lookup_max,
                "adaptive": FLAGS.speculative_adaptive}
        if FLAGS.num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = FLAGS.num_speculative_tokens
        if FLAGS.speculative_model is not None:  # set with another method: a clear error
            spec["model"] = FLAGS.speculative_model
        if FLAGS.speculative_quantization != _S.quantization:
            spec["quantization"] = FLAGS.speculative_quantization
        options["speculative_config"] = spec
    return options
