"""OpenAI-compatible HTTP serving: async engine loop, request translation, the FastAPI app."""

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.client import EngineOverloaded
from jaxserve.server.app import ServerConfig, build_app
from jaxserve.server.protocol import APIError, ProtocolContext, parse_request

__all__ = ["APIError", "AsyncEngine", "EngineOverloaded", "ProtocolContext", "ServerConfig",
           "build_app", "parse_request"]
