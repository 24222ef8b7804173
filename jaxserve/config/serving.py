"""How `jaxserve serve` serves (ServingConfig, requested): where it listens, who may call it,
the limits a request body meets, how tool calls and reasoning are read from the text, and how
it starts and stops. Its flags are generated from these fields (cli/serve.py); the server
resolves it into the app's ServerConfig (server/app.py: the key file read, the parsers
checked)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import check_choices, option

# The names of server/tool_parsers.PARSERS and server/reasoning.REASONING_PARSERS (a test keeps
# them equal; the config layer imports nothing of the server).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")
COMPILE_WARMUPS = ("none", "default", "full")
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
    shutdown_timeout: float = option(
        30.0, "On SIGINT/SIGTERM: stop accepting, let live requests finish for this many "
        "seconds, then fail the rest with errors and exit 0. A second signal exits at once.")
    max_body_bytes: int = option(4 * 1024 * 1024, "Largest request body accepted.")
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
    compile_warmup: str = option(
        "default", "Compile step shapes before taking traffic (/health/ready answers 503 "
        "meanwhile): default = every shape of a packed backend (cpu), the pure decode and "
        "prefill buckets of the others; full = every bucket combination; none = compile on "
        "first use.", choices=COMPILE_WARMUPS)
    log_level: str = option("info", "uvicorn log level.", choices=LOG_LEVELS)

    def __post_init__(self):
        check_choices(self)
        checks = (
            (0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}"),
            (self.shutdown_timeout >= 0,
             f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}"),
            (self.max_tokens_limit is None or self.max_tokens_limit >= 1,
             f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
