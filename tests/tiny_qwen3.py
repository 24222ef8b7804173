"""A tiny seeded Qwen3-style checkpoint for agent tests: a transformers Qwen3ForCausalLM (two
layers, hidden 64, q/k norms) saved as safetensors with a byte-level tokenizer whose markup is
special tokens (`<|im_start|>`, `<|im_end|>`, `<tool_call>`, `</tool_call>`, `<think>`,
`</think>`) and a hermes-style chat template (Qwen's shape) that renders `tools`, assistant
`tool_calls` and `tool` messages with their `tool_call_id`. Written once per directory and
loaded through jaxserve's own Hugging Face loader; its text is gibberish, so tests steer it
with logit_bias."""

from __future__ import annotations

import json
import os

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from jaxserve.tokenizer import Tokenizer

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
           "<think>", "</think>", "<|python_start|>", "<|python_end|>")
VOCAB = 272  # 256 bytes, the special tokens, padding to a multiple of 16
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}<tool_call>
{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def byte_backend(special: tuple[str, ...]) -> tokenizers.Tokenizer:
    """One token per byte (ids 0-255), then `special` as special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return backend


def qwen3_tokenizer() -> Tokenizer:
    """One token per byte (ids 0-255), then the special tokens; EOS is `<|im_end|>`."""
    backend = byte_backend(SPECIAL)
    return Tokenizer(backend, bos_token_id=None,
                     eos_token_ids=[backend.token_to_id("<|im_end|>")],
                     chat_template=CHAT_TEMPLATE)


def write_tiny_qwen3(directory: str, seed: int = 0) -> str:
    """The checkpoint in `directory` (config.json, model.safetensors, tokenizer files)."""
    import torch
    import transformers

    tokenizer = qwen3_tokenizer()
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_ids[0], bos_token_id=None)
    model = transformers.Qwen3ForCausalLM(config).eval().float()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory)
    with open(os.path.join(directory, "special_tokens.json"), "w") as f:
        json.dump({t: tokenizer.backend.token_to_id(t) for t in SPECIAL}, f)
    return directory
