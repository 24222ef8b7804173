"""Where `jaxserve serve` listens. `bind` takes the socket before anything slow, so a port in use
is found at once, not after the model loads. `read_timeout_protocol` is uvicorn's HTTP protocol
with a read timeout, which uvicorn lacks (its keep-alive timeout stops once a byte arrives: a
connection holding half its headers was held for good): a request's headers and body must
arrive within the timeout of the connection or of the previous response, or the client gets a
408 and the connection closes."""

from __future__ import annotations

import json
import socket

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); OSError if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _timed_out_response(seconds: float) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request was not received within {seconds:g} s (read_timeout)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def read_timeout_protocol(seconds: float, base: type = AutoHTTPProtocol) -> type:
    """`base` (uvicorn's h11 or httptools protocol) with the read timeout; uvicorn.Config's
    `http`."""

    class ReadTimeoutProtocol(base):
        _read_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()  # the next request on this connection

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            if not self.transport.is_closing():
                self._read_timer = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self):
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _timed_out(self):
            self._read_timer = None
            cycle = self.cycle  # the request being read or answered; None before the first
            if cycle is not None and not cycle.response_complete \
                    and (cycle.response_started or not cycle.more_body):
                return  # read in time: the app answers it, and the timer rearms after that
            if not self.transport.is_closing():
                self.transport.write(_timed_out_response(seconds))
                self.transport.close()

    return ReadTimeoutProtocol
