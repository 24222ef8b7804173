"""The engine: LLMEngine (add_request / abort / step, planning the next step while the device
runs this one) and AsyncEngine, which drives it from a thread for the server."""

from jaxserve.engine.llm_engine import LLMEngine, Prompt, RequestRejected

__all__ = ["LLMEngine", "Prompt", "RequestRejected"]
