"""The engine's configuration: sub-configs by concern, flags generated from their fields (one
source of defaults, help and choices), flat options mapped in one place, and the requested
config left as asked while the engine resolves its own values."""

from __future__ import annotations

import dataclasses

import pytest
from absl import flags

from jaxserve.cli import engine_flags
from jaxserve.config import (OPTION_GROUPS, CacheConfig, EngineConfig, ResolvedConfig,
                             SpeculativeConfig, option_names)
from jaxserve.config.options import option
from jaxserve.engine import LLMEngine
from tiny_model import tiny_loaded

CONFIG_CLASSES = (*OPTION_GROUPS.values(), SpeculativeConfig)


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_flag_takes_its_default_help_and_choices_from_its_field(cls):
    for field in dataclasses.fields(cls):
        flag = flags.FLAGS[engine_flags.flag_name(field)]
        switch = field.metadata["switch"]
        default = tuple(flag.default) if isinstance(flag.default, list) else flag.default
        assert default == (None if switch else field.default), field.name  # a repeated flag's: list
        choices = field.metadata["choices"]
        prefix = f"<{'|'.join(choices)}>: " if choices else ""  # absl's enum help starts so
        assert flag.help.startswith(prefix + field.metadata["help"]), field.name
        assert getattr(flag.parser, "enum_values", None) == (list(choices) if choices else None)


def test_a_changed_field_default_shows_up_in_its_flag():
    @dataclasses.dataclass(frozen=True)
    class BiggerPages(CacheConfig):
        page_size: int = option(32, "KV slots per page, doubled.")

    values = flags.FlagValues()
    engine_flags.define_flags(BiggerPages, values)
    assert values["page_size"].default == 32
    assert values["page_size"].help == "KV slots per page, doubled."
    assert values["kv_cache_dtype"].default == CacheConfig().kv_cache_dtype


def _parsed(*argv: str) -> flags.FlagValues:
    values = flags.FlagValues()
    for cls in CONFIG_CLASSES:
        engine_flags.define_flags(cls, values)
    values(["prog", *argv])
    return values


def test_flags_map_onto_the_nested_config():
    config = EngineConfig.from_options(**engine_flags.engine_options(_parsed()))
    assert config == EngineConfig() and config.speculative is None
    config = EngineConfig.from_options(**engine_flags.engine_options(_parsed(
        "--page_size=8", "--dtype=float32", "--max_num_seqs=4", "--max_num_batched_tokens=64",
        "--tensor_parallel_size=2", "--num_speculative_tokens=3", "--speculative_adaptive=false")))
    assert (config.cache.page_size, config.load.dtype, config.scheduler.max_num_seqs,
            config.parallel.tensor_parallel_size) == (8, "float32", 4, 2)
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=3, adaptive=False)


def test_flat_options_round_trip_and_unknown_names_list_the_known_ones():
    config = EngineConfig.from_options(page_size=8, num_pages=40, scheduling="static",
                                       speculative_config={"method": "ngram"})
    assert EngineConfig.from_options(**config.options()) == config
    assert set(config.options()) == set(option_names())
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['page_sizes'\]; known "
                                         r"options: \['async_scheduling', "):
        EngineConfig.from_options(page_sizes=8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="EngineConfig.cache must be a CacheConfig"):
        EngineConfig(cache={"page_size": 8})


def test_the_engine_resolves_into_its_own_object_and_leaves_the_request_as_asked():
    loaded = tiny_loaded()
    config = EngineConfig.from_options(num_pages=16, max_num_seqs=2, max_num_batched_tokens=32,
                                       attention_backend="xla")
    asked = dataclasses.replace(config)  # an equal copy, to compare against afterwards
    engine = LLMEngine(config, loaded)
    assert engine.config is config and config == asked
    assert (config.load.dtype, config.cache.kv_cache_dtype, config.scheduler.max_model_len,
            config.scheduler.prefill_keys_per_token) == ("auto", "auto", None, None)
    model = loaded.config
    want = ResolvedConfig(dtype="float32", kv_cache_dtype="float32",
                          max_model_len=model.max_position_embeddings,
                          prefill_keys_per_token=engine.scheduler.budget.keys_per_token,
                          backend="xla")
    assert engine.resolved == want and engine.max_model_len == want.max_model_len
    assert want.prefill_keys_per_token >= 1
    assert engine.kv_usage()["bytes_per_slot"] == model.kv_bytes_per_token(4)


def test_serve_flags_come_from_the_serving_config_and_resolve_into_the_apps():
    """`jaxserve serve`'s own flags are ServingConfig's and ProtocolConfig's fields (repeated
    ones as tuples), and ServerConfig.of resolves them: keys read, a key file without keys
    refused. `jaxserve batch` reads rows with ProtocolConfig's flags, the same ones."""
    from jaxserve.config.serving import (
        REASONING_PARSERS, TOOL_CALL_PARSERS, ProtocolConfig, ServingConfig)
    from jaxserve.server import reasoning, tool_parsers
    from jaxserve.server.app import ServerConfig

    def serve_flags():
        values = flags.FlagValues()
        for cls in (ServingConfig, ProtocolConfig):
            engine_flags.define_flags(cls, values)
        return values

    values = serve_flags()
    for field in dataclasses.fields(ServingConfig) + dataclasses.fields(ProtocolConfig):
        flag = values[field.name]
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        assert flag.default == default, field.name
        assert field.metadata["help"] in flag.help, field.name
    values(["serve"])
    assert engine_flags.config_of(ServingConfig, values) == ServingConfig()
    assert engine_flags.config_of(ProtocolConfig, values) == ProtocolConfig()
    assert ServerConfig.of(ServingConfig()) == ServerConfig()
    values = serve_flags()
    values(["serve", "--api_key=a", "--api_key=b", "--served_model_name=m", "--port=9",
            "--tool_call_parser=pythonic", "--max_tokens_limit=5", "--reasoning_parser=qwen3"])
    serving = engine_flags.config_of(ServingConfig, values)
    protocol = engine_flags.config_of(ProtocolConfig, values)
    assert (serving.api_key, protocol.served_model_name, serving.port) == (("a", "b"), ("m",), 9)
    server = ServerConfig.of(serving, protocol, env_key="ignored: keys were given")
    assert server.keys == (("a", "key0"), ("b", "key1"))
    assert (server.served_model_names, server.tool_call_parser, server.max_tokens_limit,
            server.reasoning_parser) == (("m",), "pythonic", 5, "qwen3")
    assert protocol.context_options() == {"model_names": ("m",), "max_tokens_limit": 5,
                                           "tool_call_parser": "pythonic",
                                           "reasoning_parser": "qwen3"}
    assert ProtocolConfig().context_options()["reasoning_parser"] is None  # "none"
    # the config layer names the server's parsers without importing them
    assert set(TOOL_CALL_PARSERS) == {"auto", *tool_parsers.PARSERS}
    assert set(REASONING_PARSERS) == {"none", *reasoning.REASONING_PARSERS}
    with pytest.raises(ValueError, match="port must be in"):
        ServingConfig(port=70000)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ProtocolConfig(tool_call_parser="xml")
    with pytest.raises(ValueError, match="max_tokens_limit must be >= 1"):
        ProtocolConfig(max_tokens_limit=0)
    with pytest.raises(ValueError, match="JAXSERVE_API_KEY is set but empty"):
        ServerConfig.of(ServingConfig(), env_key=" ")
