"""How `jaxserve serve` serves (ServingConfig, requested): where it listens, who may call it and
how it starts and stops; and how a request body is read (ProtocolConfig, which `jaxserve batch`
shares): the limits it meets, the model names it may use, how tool calls and reasoning are read
from the text. Their flags are generated from these fields (cli/serve.py, cli/batch.py); the
server resolves them into the app's ServerConfig (server/app.py: the key file read, the parsers
checked)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import check_choices, option

# The names of server/tool_parsers.PARSERS and server/reasoning.REASONING_PARSERS (a test keeps
# them equal; the config layer imports nothing of the server).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")
COMPILE_WARMUPS = ("none", "default", "full")
READY_AFTER = ("start", "all")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    host: str = option("127.0.0.1", "Address to bind (loopback unless told otherwise).")
    port: int = option(8000, "TCP port.")
    api_key: tuple[str, ...] = option(
        (), "Require 'Authorization: Bearer <key>' on /v1, /debug, /metrics and the docs; "
        "repeat for several keys, each its own tenant (default: env JAXSERVE_API_KEY).")
    api_key_file: str | None = option(
        None, "A file of 'key tenant' lines ('#' at a line's start: a comment): each tenant's "
        "prefix-cache salt is derived from its name, so tenants share no cached pages. A file "
        "with no key refuses to start.")
    public_metrics: bool = option(
        False, "With keys, leave /metrics open (by default it needs a key too: it shows every "
        "tenant's traffic).")
    operator_key: tuple[str, ...] = option(
        (), "A key for /metrics and /debug (they show every tenant's traffic): with more than "
        "one tenant, tenants' keys get 403 there; repeat for several.")
    enable_weight_updates: bool = option(
        False, "Serve /update_weights (weights from a safetensors or orbax path on the server), "
        "/pause, /resume, /sleep, /wake_up and their states (docs/rl.md). They need a key "
        "(an operator key with several tenants): without --api_key, --api_key_file, "
        "JAXSERVE_API_KEY or --operator_key the server refuses to start.")
    allow_runtime_lora_updates: bool = option(
        False, "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter ({lora_name, "
        "lora_path}: a PEFT directory on the server; needs --enable_lora). They need a key "
        "(an operator key with several tenants): without one the server refuses to start.")
    shutdown_timeout: float = option(
        30.0, "On SIGINT/SIGTERM: stop accepting, let live requests finish for this many "
        "seconds, then fail the rest with errors and exit 0. A second signal exits at once.")
    max_body_bytes: int = option(4 * 1024 * 1024, "Largest request body accepted.")
    compile_warmup: str = option(
        "default", "Compile step shapes before taking traffic (/health/ready answers 503 "
        "meanwhile): default = every shape of a packed backend (cpu), the pure decode and "
        "prefill buckets of the others; full = every bucket combination, and the sampling "
        "calls of top logprobs, penalties and logit_bias; none = compile on first use.",
        choices=COMPILE_WARMUPS)
    ready_after: str = option(
        "start", "When /health/ready turns 200: start = once the first shapes are compiled (the "
        "rest compile in the background while requests are served, the first ones slower); "
        "all = once every warm-up shape is compiled.", choices=READY_AFTER)
    stall_timeout: float = option(
        60.0, "/health/ready answers 503 'stalled' when the engine loop has not come round for "
        "this many seconds (a step or a command holding it).")
    read_timeout: float = option(
        30.0, "Seconds a client has to send a request's headers and body (from the connection "
        "or the previous response); then 408 and the connection is closed.")
    max_waiting: int | None = option(
        None, "Refuse new requests (503, retry later) beyond this many waiting in the engine; "
        "a request of more prompts than that can never wait (400).")
    max_prompts_per_request: int = option(
        256, "Most prompts one /v1/completions body may hold (more: a 400); `jaxserve batch` "
        "runs larger sets.")
    max_tools: int = option(
        128, "Most tools one chat body may offer (more: a 400, before any is read).")
    max_tools_bytes: int = option(
        1024 * 1024, "Largest size of a chat body's tools as JSON, descriptions and schemas "
        "(more: a 400, before any is rendered or compiled).")
    max_prompt_chars: int | None = option(
        None, "Longest prompt text accepted, in characters, checked before tokenizing (a "
        "completion's prompt, a chat's message contents together; more: a 400). Default: 32 "
        "per token of max_model_len.")
    log_level: str = option("info", "uvicorn log level.", choices=LOG_LEVELS)

    def __post_init__(self):
        check_choices(self)
        checks = (
            (0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}"),
            (self.shutdown_timeout >= 0,
             f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}"),
            (self.stall_timeout > 0, f"stall_timeout must be > 0, got {self.stall_timeout}"),
            (self.read_timeout > 0, f"read_timeout must be > 0, got {self.read_timeout}"),
            (self.max_waiting is None or self.max_waiting >= 0,
             f"max_waiting must be >= 0, got {self.max_waiting}"),
            (self.max_prompts_per_request >= 1,
             f"max_prompts_per_request must be >= 1, got {self.max_prompts_per_request}"),
            (self.max_tools >= 1, f"max_tools must be >= 1, got {self.max_tools}"),
            (self.max_tools_bytes >= 1,
             f"max_tools_bytes must be >= 1, got {self.max_tools_bytes}"),
            (self.max_prompt_chars is None or self.max_prompt_chars >= 1,
             f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class ProtocolConfig:
    max_tokens_limit: int | None = option(
        None, "Largest max_tokens accepted (default: the context).")
    served_model_name: tuple[str, ...] = option(
        (), "Model name(s) clients use (default: --model).")
    tool_call_parser: str = option(
        "auto", "How tool calls are read from the text when a request offers tools with "
        "tool_choice 'auto' (or none): auto = the format the chat template's markup shows, "
        "hermes when it shows none.", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str = option(
        "none", "Split <think>...</think> reasoning into message.reasoning_content.",
        choices=REASONING_PARSERS)

    def __post_init__(self):
        check_choices(self)
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")

    def context_options(self) -> dict:
        """server.protocol.ProtocolContext.for_engine's keywords."""
        return {"model_names": self.served_model_name or None,
                "max_tokens_limit": self.max_tokens_limit,
                "tool_call_parser": self.tool_call_parser,
                "reasoning_parser": None if self.reasoning_parser == "none"
                else self.reasoning_parser}
