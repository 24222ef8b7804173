"""What the model is: its decoder's shape (ModelConfig) and rotary scaling (RopeScaling), read
from a checkpoint's metadata and validated on construction."""

from __future__ import annotations

import dataclasses
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
    # A learned logit per query head in each softmax's denominator, with no value (gpt-oss;
    # model/attention.py's attend(sinks=)); the params then hold each layer's sinks f[Hq].
    attention_sinks: bool = False
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Mixture of experts (Mixtral, Qwen3-MoE; model/moe.py): num_experts > 0 makes layer i
    # sparse unless i is in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step
    # (Qwen3-MoE's dense layers among sparse ones, with the dense intermediate_size). A sparse
    # layer routes each token to num_experts_per_tok experts of moe_intermediate_size columns,
    # weighted by the router's softmax over all experts, renormalised over the chosen ones
    # when norm_topk_prob (Mixtral always; Qwen3-MoE by its config).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # gpt-oss's experts: a clamped SwiGLU, (min(up, limit) clipped at -limit too, + 1) *
    # g * sigmoid(alpha * g) with g = min(gate, limit) (model/moe.py); None: activation(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

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
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # JSON lists
        if self.num_experts:
            self._check_experts()
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                     "swiglu_limit"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")

    def _check_experts(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}),"
                             f" got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError("moe_intermediate_size and decoder_sparse_step must be >= 1, got "
                             f"{self.moe_intermediate_size} and {self.decoder_sparse_step}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {outside} are not layers of the model "
                             f"(0..{self.num_layers - 1})")

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else the dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

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
        """Matmul FLOPs per token for the weights (2 per multiply-add), attention excluded; a
        sparse layer counts its router and the experts a token is routed to."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) + (self.num_heads * d) * h
        sparse = sum(map(self.layer_is_sparse, range(self.num_layers)))
        mlp = (3 * h * self.intermediate_size * (self.num_layers - sparse)
               + sparse * h * (self.num_experts + 3 * self.num_experts_per_tok
                               * self.moe_intermediate_size))
        return 2.0 * (self.num_layers * attn + mlp + h * self.vocab_size)

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
