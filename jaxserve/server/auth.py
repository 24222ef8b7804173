"""Who may call the server: API keys, each a tenant's (`--api_key`, `--api_key_file`,
JAXSERVE_API_KEY), and operator keys for the paths that show every tenant's traffic. The
middleware compares keys in constant time and puts the caller's tenant in the request's state
(its prefix-cache salt is derived from it, server/app.py)."""

from __future__ import annotations

import hmac

from jaxserve.server.json_io import StrictJSONResponse
from jaxserve.server.protocol import APIError
from jaxserve.server.lora_routes import PATHS as LORA_PATHS
from jaxserve.server.weight_routes import PATHS as WEIGHT_PATHS

# The tenant of an operator key: holds a space, which no tenant of a key file or flag can.
OPERATOR = "operator key"


def read_api_keys(path: str) -> tuple[tuple[str, str], ...]:
    """A file of `key tenant` lines; blank lines and lines whose first character (after leading
    spaces) is `#` are skipped, so a key or tenant may hold `#`. A file with no key, or one that
    lists a key twice, is refused: an empty file must never mean "no authentication"."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'key tenant', got {len(parts)} fields")
            pairs.append((parts[0], parts[1]))
    if not pairs:
        raise ValueError(f"api_key_file {path} holds no keys (an empty key file would leave the "
                         "server open)")
    return tuple(pairs)


def resolve_api_keys(flag_keys: list[str] | None, key_file: str | None,
                     env_key: str | None) -> tuple[tuple[str, str], ...]:
    """The (key, tenant) pairs a server requires, from --api_key (tenants key0, key1, ...),
    --api_key_file and, when neither is given, JAXSERVE_API_KEY (tenant "default"). Empty means
    no authentication: only when nothing asked for a key. A key source that was given but holds
    no key raises ValueError, so a misconfigured server refuses to start rather than start open."""
    keys = [(k, f"key{i}") for i, k in enumerate(flag_keys or [])]
    if key_file:
        keys += read_api_keys(key_file)
    if env_key is not None and not keys:
        if not env_key.strip():
            raise ValueError("JAXSERVE_API_KEY is set but empty")
        keys = [(env_key.strip(), "default")]
    return tuple(keys)


class AuthMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched). Puts the key's tenant in
    scope["state"]["tenant"]. With more than one tenant, /metrics and /debug (every tenant's
    traffic) answer 403 to all but an operator key, and so do the weight and LoRA adapter
    endpoints (weight_routes.py, lora_routes.py: they change what every tenant is served)."""

    PROTECTED = ("/v1", "/debug", "/docs", "/redoc", "/openapi.json", "/metrics", *WEIGHT_PATHS,
                 *LORA_PATHS)
    OPERATOR_ONLY = ("/debug", "/metrics", *WEIGHT_PATHS, *LORA_PATHS)

    def __init__(self, app, keys: tuple[tuple[str, str], ...], public: tuple[str, ...] = ()):
        self.app = app
        self.keys = [(key.encode(), tenant) for key, tenant in keys]
        self.protected = tuple(p for p in self.PROTECTED if p not in public)
        tenants = {tenant for _, tenant in keys if tenant != OPERATOR}
        self.operator_only = tuple(p for p in self.OPERATOR_ONLY if p in self.protected
                                   and len(tenants) > 1)

    def _tenant(self, token: bytes) -> str | None:
        tenant = None
        for key, name in self.keys:  # every key compared, in constant time
            if hmac.compare_digest(token, key):
                tenant = name
        return tenant

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.protected):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            tenant = self._tenant(token.strip()) if scheme.lower() == b"bearer" else None
            scope.setdefault("state", {})["tenant"] = tenant
            if tenant is None:
                err = APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               status=401, code="invalid_api_key")
                response = StrictJSONResponse(err.body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            if tenant != OPERATOR and scope["path"].startswith(self.operator_only):
                err = APIError(f"{scope['path']} shows or changes every tenant's traffic: it "
                               "needs an operator key (--operator_key)", status=403,
                               type="permission_error", code="operator_key_required")
                await StrictJSONResponse(err.body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
