"""Frozen configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig).

Both are validated on construction; flags and `LLM(**options)` map onto EngineConfig in one place
(`EngineConfig.from_options`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


ROPE_SCALINGS = ("linear", "llama3", "yarn", "freq_factors")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama); GeGLU with tanh-approximated gelu (Gemma)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling past the pretrained context, as Hugging Face's rope_type names it
    (jaxserve/model/rope.py computes it), or "freq_factors": a divisor per rotated pair as
    llama.cpp stores a scaling in GGUF (its rope_freqs tensor, e.g. llama3's). "dynamic" (NTK) is
    refused: its frequencies depend on the sequence's length, so a cached page's keys would not
    match a later step's."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None  # llama3 and yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: from factor (and mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: correction range to whole dimensions
    freq_factors: tuple[float, ...] | None = None  # freq_factors: one per rotated pair

    def __post_init__(self):
        if self.rope_type == "dynamic":
            raise ValueError("rope scaling 'dynamic' is not supported: its frequencies depend on "
                             "the sequence length, so cached KV pages would not match")
        if self.rope_type not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.rope_type!r} is not supported (supported: "
                             f"{ROPE_SCALINGS})")
        if not self.factor or self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor!r}")
        if (self.rope_type == "freq_factors") != (self.freq_factors is not None):
            raise ValueError("freq_factors (and only it) takes a divisor per rotated pair")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ValueError(f"rope scaling {self.rope_type!r} needs "
                             "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder shape. Built from GGUF metadata or a Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before rope (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    rope_scaling: RopeScaling | None = None
    # Sliding-window attention: a windowed layer's query at position p attends keys at
    # positions > p - sliding_window. layer_types names each layer's kind (LAYER_TYPES); None
    # with a window: every layer is windowed (Mistral).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # rope base of sliding layers (Gemma 3); None: rope_theta
    mlp_activation: str = "silu"
    embed_scale: bool = False  # embeddings times sqrt(hidden), rounded to the model dtype (Gemma)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight) (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and MLP too, before the residual (Gemma 2/3)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim's
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp activation {self.mlp_activation!r} is not supported "
                             f"(supported: {MLP_ACTIVATIONS})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model "
                                 f"has {self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer type(s) {unknown} are not supported (supported: "
                                 f"{LAYER_TYPES})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("sliding_attention layers need a sliding_window")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends its whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer is windowed: keys older than it are never read again, so
        their pages can be released (core/kv_manager.py). None when any layer attends all."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return None if None in windows else self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """2 (K and V) * layers * KV heads * (head dim * bytes per scalar + bytes of the scale
        an int8 slot keeps per KV head)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes
                                                          + scale_bytes)

    def flops_per_token(self) -> float:
        """Matmul FLOPs per token for the weights (2 per multiply-add), attention excluded."""
        h, d = self.hidden_size, self.head_dim
        per_layer = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) \
            + (self.num_heads * d) * h + 3 * h * self.intermediate_size
        return 2.0 * (self.num_layers * per_layer + h * self.vocab_size)

    def attention_flops_per_key(self) -> float:
        """Attention FLOPs one query token spends per key it attends (scores and weighted values,
        2 per multiply-add, every query head) in the layers that attend the whole context; every
        layer when all are windowed (their context then stops at the window)."""
        full = sum(self.layer_window(i) is None for i in range(self.num_layers))
        return 4.0 * self.num_heads * self.head_dim * (full or self.num_layers)

    def fingerprint_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kv_heads_per_device(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each of tensor_parallel_size devices holds: its share, or 1 when there are
    fewer heads than devices (each head then repeated on tp / H_kv devices)."""
    hkv, tp = num_kv_heads, tensor_parallel_size
    if hkv % tp and tp % hkv:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {hkv} KV heads, "
                         "or be a multiple of them (the heads are then repeated)")
    return max(hkv // tp, 1)


SPECULATIVE_METHODS = ("ngram", "draft")
DRAFT_QUANTIZATIONS = ("none", "int8")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al.): each step proposes up to num_speculative_tokens
    tokens per decoding sequence and the target model verifies them in one chunk; the output is
    the target's own (greedy: token for token; sampled: the same distribution, and the same
    tokens for a seed). "ngram": prompt lookup, the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min). "draft": a smaller model sharing the target's tokenizer (`model`; None
    or the target's own name: the target's weights, as self-speculation with
    quantization="int8") proposes greedily, one token after another."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # "draft": name or path; None: the target's own weights
    quantization: str = "none"  # "draft": the draft's weights, "none" or "int8"
    # Choose the drafts per step from measured costs (0 where speculation does not pay, as in
    # a large batch on hardware whose step time grows with its tokens); False: always k.
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..."
                             f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative adaptive must be a bool, got {self.adaptive!r}")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative quantization must be one of {DRAFT_QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.method != "draft" and (self.model is not None or self.quantization != "none"):
            raise ValueError(f"a speculative model and quantization belong to method 'draft', "
                             f"not {self.method!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {lo!r} and {hi!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig, or a dict of its fields (unknown names are errors), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got "
                             f"{type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


SCHEDULING_POLICIES = ("iteration", "static")
PRIORITY_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "cpu", "xla", "pallas")
PALLAS_KERNELS = ("auto", "tpu", "gpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
QUANTIZATIONS = ("none", "int8", "bf16")
# An accelerator engine's share of its allocator's memory when no budget or pool size is given:
# vLLM's default, leaving a tenth for what no plan sees (other processes' contexts, fragmentation).
DEFAULT_MEMORY_UTILIZATION = 0.9
# Bytes of a KV slot's scalar, and of the float32 scale an int8 slot keeps per KV head.
KV_SCALAR_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
KV_SCALE_BYTES = {"int8": 4}


def kv_slot_bytes(kv_cache_dtype: str) -> tuple[int, int]:
    """(bytes per KV scalar, bytes of the scale per KV head and token) for a resolved dtype."""
    if kv_cache_dtype not in KV_SCALAR_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_SCALAR_BYTES)} once "
                         f"resolved, got {kv_cache_dtype!r}")
    return KV_SCALAR_BYTES[kv_cache_dtype], KV_SCALE_BYTES.get(kv_cache_dtype, 0)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: memory budget, batching limits and policies."""

    model: str = "smollm2-135m"
    # Weights, activations and KV pool. auto: bfloat16 on GPU and TPU (softmax statistics stay
    # float32 inside the kernels), float32 on CPU (jaxserve.backends.resolve_dtype).
    dtype: str = "auto"
    # The KV pool's pages. auto: the same as dtype. "int8": symmetric, a float32 scale per token
    # and KV head beside the pages (about 4x the tokens of a float32 pool in the same bytes).
    kv_cache_dtype: str = "auto"
    # "int8": weight-only, a scale and an offset per group of 32 input channels. "bf16": weights and matmul inputs rounded to
    # bfloat16, products summed in f32 on AMX tiles (CPUs with AMX-BF16, the "cpu" backend).
    quantization: str = "none"
    # auto: the Pallas kernels on TPU and GPU; on CPU the C++ kernels, else xla (backends.resolve)
    attention_backend: str = "auto"
    # The Pallas kernel family: auto is the device's own; on a CPU (interpret mode, for tests
    # and debugging) "tpu" unless "gpu" is asked for.
    pallas_kernels: str = "auto"
    page_size: int = 16
    # The engine's memory per device, planned once (engine/memory_plan.py): weights, the largest
    # step's activations and the runtime measured, the KV pool gets the rest. Either bytes, or a
    # fraction of the device's memory (an accelerator's allocator limit; on CPU, physical RAM).
    # Neither: DEFAULT_MEMORY_UTILIZATION on accelerators; on CPU the pool sizes below.
    memory_budget_bytes: int | None = None
    memory_utilization: float | None = None
    # Overrides of the plan: the pool's size, as pages (scratch page 0 included) or KV bytes.
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Chunked prefill weighs a chunk's context: each token of a prefill chunk counts
    # 1 + c / prefill_keys_per_token against max_num_batched_tokens, c = the tokens before the
    # chunk (every one of its tokens attends them all), so a chunk deep into a long prompt is cut
    # shorter and a step costs about what a max_num_batched_tokens chunk at a prompt's start
    # does. The value is the keys whose attention costs as much as one token's weight matmuls.
    # None: from the model's arithmetic and the attention backend's speed
    # (resolved_prefill_keys_per_token); 0: tokens alone count. Decode rows count one each.
    prefill_keys_per_token: int | None = None
    scheduling: str = "iteration"
    scheduling_policy: str = "fcfs"
    # Plan and launch the next decode step before reading back this one's tokens (engine.step).
    async_scheduling: bool = True
    # Collapse the weights' host memory into 2 MiB pages (jaxserve.backends.cpu.huge_pages).
    huge_pages: bool = True
    watermark: float = 0.01  # fraction of pages kept free when admitting new requests
    cache_salt: str | None = None
    seed: int = 0
    max_waiting: int | None = None  # front ends refuse new requests beyond this queue length
    # Speculative decoding (SpeculativeConfig, or a dict of its fields); None: off.
    speculative_config: SpeculativeConfig | None = None
    # Devices: a ("dp", "tp") mesh of data_parallel_size replicas (each its own scheduler and
    # KV pool) of tensor_parallel_size devices each (jaxserve/runtime/sharding.py).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Several processes (hosts) as one engine (jaxserve/runtime/distributed.py): process 0
    # schedules, every process runs each step on its devices of the one mesh.
    coordinator_address: str | None = None  # host:port of process 0's coordinator
    num_processes: int = 1
    process_id: int = 0
    # A process not joined within this, or a peer silent for a sixth of it, ends the run.
    distributed_timeout_s: int = 60

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(self.quantization in QUANTIZATIONS,
              f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check(self.attention_backend in ATTENTION_BACKENDS,
              f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        check(self.pallas_kernels in PALLAS_KERNELS,
              f"pallas_kernels must be one of {PALLAS_KERNELS}, got {self.pallas_kernels!r}")
        check(self.scheduling in SCHEDULING_POLICIES,
              f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        check(self.scheduling_policy in PRIORITY_POLICIES,
              f"scheduling_policy must be one of {PRIORITY_POLICIES}, got {self.scheduling_policy!r}")
        check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        check(self.num_pages is None or self.num_pages >= 2,
              f"num_pages must be >= 2 (page 0 is reserved scratch), got {self.num_pages}")
        check(self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
              f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        check(self.num_pages is None or self.kv_cache_bytes is None,
              "give num_pages or kv_cache_bytes, not both")
        check(self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
              f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")
        check(self.memory_utilization is None or 0.0 < self.memory_utilization <= 1.0,
              f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        check(self.memory_budget_bytes is None or self.memory_utilization is None,
              "give memory_budget_bytes or memory_utilization, not both")
        check(self.max_model_len is None or self.max_model_len >= 2,
              f"max_model_len must be >= 2, got {self.max_model_len}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= self.max_num_seqs,
              f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
              f"({self.max_num_seqs}) so every running sequence can decode each step")
        check(self.prefill_keys_per_token is None or self.prefill_keys_per_token >= 0,
              f"prefill_keys_per_token must be >= 0 or None, got {self.prefill_keys_per_token}")
        check(0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            n = getattr(self, name)
            check(isinstance(n, int) and not isinstance(n, bool) and n >= 1,
                  f"{name} must be an integer >= 1, got {n!r}")
        check(isinstance(self.num_processes, int) and self.num_processes >= 1,
              f"num_processes must be an integer >= 1, got {self.num_processes!r}")
        check(isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes,
              f"process_id must be in 0..{self.num_processes - 1}, got {self.process_id!r}")
        check(self.num_processes == 1 or self.coordinator_address,
              "num_processes > 1 needs coordinator_address (host:port of process 0)")
        check(isinstance(self.distributed_timeout_s, int) and self.distributed_timeout_s >= 1,
              f"distributed_timeout_s must be an integer >= 1, got {self.distributed_timeout_s!r}")
        spec = self.speculative_config
        check(self.num_processes == 1 or spec is None or spec.method != "draft",
              "speculative method 'draft' runs its model on process 0 alone; with "
              "num_processes > 1 use method 'ngram'")
        check(self.num_processes == 1 or self.data_parallel_size == 1,
              "several processes serve one tensor-parallel engine; data_parallel_size must be 1")
        check(self.max_waiting is None or self.max_waiting >= 0,
              f"max_waiting must be >= 0, got {self.max_waiting}")

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from keyword options, refusing unknown names with the list of known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """kv_cache_dtype with auto meaning dtype (which must be resolved already)."""
        kv = self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        if kv == "auto":
            raise ValueError("dtype 'auto' is resolved per device (backends.resolve_dtype) first")
        return kv

    def resolved_prefill_keys_per_token(self, model: ModelConfig, attention_cost: float) -> int:
        """prefill_keys_per_token, None resolved: the model's weight FLOPs per token over its
        attention FLOPs per key, divided by attention_cost (how many times longer a FLOP of the
        attention backend takes than one of its matmuls, backends.Backend.attention_cost)."""
        if self.prefill_keys_per_token is not None:
            return self.prefill_keys_per_token
        keys = model.flops_per_token() / (model.attention_flops_per_key() * attention_cost)
        return max(1, round(keys))

    def kv_bytes_per_token(self, model: ModelConfig) -> int:
        """One token's KV bytes over all layers, scales included."""
        return model.kv_bytes_per_token(*kv_slot_bytes(self.resolved_kv_cache_dtype))

    def planned_utilization(self, platform: str) -> float | None:
        """memory_utilization, or the accelerator default when nothing sizes the pool."""
        sized = (self.memory_budget_bytes, self.num_pages, self.kv_cache_bytes)
        if self.memory_utilization is None and platform != "cpu" and sized == (None,) * 3:
            return DEFAULT_MEMORY_UTILIZATION
        return self.memory_utilization

    def resolve_num_pages(self, model: ModelConfig, max_model_len: int,
                          draft: ModelConfig | None = None) -> int:
        """Total pages (scratch page 0 included) from num_pages, a byte budget, or a default
        that holds max_num_seqs sequences of min(max_model_len, 512) tokens each. A draft
        model's pool (speculative method "draft") has as many pages, of its own shape: a byte
        budget pays for both."""
        if self.num_pages is not None:
            return self.num_pages
        page_bytes = self.kv_bytes_per_token(model) * self.page_size
        if draft is not None:
            page_bytes += self.kv_bytes_per_token(draft) * self.page_size
        if self.kv_cache_bytes is not None:
            pages = self.kv_cache_bytes // page_bytes
            if pages < 2:
                raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} holds {pages} page(s) of "
                                 f"{page_bytes} bytes; at least 2 are needed")
            return int(pages)
        per_seq = math.ceil(min(max_model_len, 512) / self.page_size)
        return 1 + self.max_num_seqs * per_seq
