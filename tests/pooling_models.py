"""Tiny seeded pooling checkpoints for tests/test_pooling.py and the server's pooling tests:
a Qwen3 and a Llama decoder saved as sentence-transformers models (last-token pooling with
Normalize, and mean pooling without), and a Qwen2ForSequenceClassification with three labels.
Byte-level tokenizers (one token per byte, so lengths are easy to steer) with special tokens
added by the tokenizer's post-processor as real checkpoints do: the Qwen3 appends
<|endoftext|> (Qwen3-Embedding's shape), the Llama prepends <s>. Written once per directory;
the references are sentence-transformers and transformers loading the same files."""

from __future__ import annotations

import os

from tokenizers import processors

from tiny_qwen3 import byte_backend

VOCAB = 272  # 256 bytes, the special tokens, padding
SPECIAL = ("<|endoftext|>", "<s>", "</s>")
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-6)


def byte_tokenizer(template: str | None):
    """One token per byte, then SPECIAL (256, 257, 258); template: the post-processor's
    single-sequence template ("$A <|endoftext|>"), None for none."""
    from jaxserve.tokenizer import Tokenizer

    backend = byte_backend(SPECIAL)
    if template is not None:
        special = [(t, backend.token_to_id(t)) for t in SPECIAL if t in template]
        backend.post_processor = processors.TemplateProcessing(
            single=template, pair=f"{template} $B:1", special_tokens=special)
    return Tokenizer(backend, bos_token_id=None,
                     eos_token_ids=[backend.token_to_id("<|endoftext|>")], chat_template=None)


def _save_hf(model, tokenizer, directory: str) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory)


def write_sentence_transformer(directory: str, family: str) -> str:
    """family "qwen3": last-token pooling + Normalize; "llama": mean pooling, no Normalize.
    The decoder is the bare *Model (AutoModel's), as sentence-transformers saves it."""
    if os.path.isfile(os.path.join(directory, "modules.json")):
        return directory
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_models

    from hf_families import seeded_model

    if family == "qwen3":
        cfg = transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)
        model, template, mode = seeded_model(transformers.Qwen3Model, cfg), \
            "$A <|endoftext|>", "lasttoken"
    else:
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
        model, template, mode = seeded_model(transformers.LlamaModel, cfg), "<s> $A", "mean"
    raw = directory + ".hf"
    _save_hf(model, byte_tokenizer(template), raw)
    transformer = st_models.Transformer(raw)
    modules = [transformer, st_models.Pooling(cfg.hidden_size, pooling_mode=mode)]
    if family == "qwen3":
        modules.append(st_models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(directory)
    return directory


def write_classifier(directory: str) -> str:
    """A Qwen2ForSequenceClassification of three labels (pad token <|endoftext|>)."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import transformers

    from hf_families import seeded_model

    cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=False, num_labels=3,
                                   pad_token_id=256,
                                   id2label={0: "negative", 1: "neutral", 2: "positive"},
                                   label2id={"negative": 0, "neutral": 1, "positive": 2})
    cfg.architectures = ["Qwen2ForSequenceClassification"]
    model = seeded_model(transformers.Qwen2ForSequenceClassification, cfg, {"score": 4.0})
    _save_hf(model, byte_tokenizer(None), directory)
    return directory


def write_causal_lm(directory: str) -> str:
    """A Qwen3ForCausalLM (tied head) to score by its logits of two tokens (a reranker's form)."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import transformers

    from hf_families import seeded_model

    cfg = transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)
    _save_hf(seeded_model(transformers.Qwen3ForCausalLM, cfg), byte_tokenizer(None), directory)
    return directory
