"""The engine: LLMEngine (add_request / abort / step, planning the next step while the device
runs this one), DataParallelEngine (the same interface over data-parallel replicas; `make_engine`
builds either), and AsyncEngine, which drives either from a thread for the server."""

from jaxserve.engine.data_parallel import DataParallelEngine, make_engine
from jaxserve.engine.llm_engine import LLMEngine, Prompt, RequestRejected

__all__ = ["DataParallelEngine", "LLMEngine", "Prompt", "RequestRejected", "make_engine"]
