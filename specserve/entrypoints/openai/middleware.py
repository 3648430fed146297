"""ASGI middleware in front of every route: API-key check and request body size limit.

Pure ASGI (not BaseHTTPMiddleware) so that streaming responses pass through untouched and a
body that is too large is refused while it arrives, whether or not it declared its length.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.entrypoints.openai.errors import BodyTooLargeError, error_body

# Paths reachable without the API key: probes and monitoring, as in vLLM.
OPEN_PATHS = ("/health", "/version", "/metrics", "/docs", "/redoc", "/openapi.json", "/ping")


async def _send_error(send: Send, status: int, message: str, code: str,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class LimitsMiddleware:
    """401 without the right ``Authorization: Bearer <key>``; 413 for bodies over the limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope) -> bool:
        if not self.api_key or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                expected = f"Bearer {self.api_key}".encode()
                return hmac.compare_digest(value.strip(), expected)
        return False

    def _declared_length(self, scope: Scope) -> int | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_error(send, 401, "invalid or missing API key: send the header "
                              "'Authorization: Bearer <key>' with the server's --api-key.",
                              "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        limit = self.max_body_bytes
        declared = self._declared_length(scope)
        if declared is not None and declared > limit:
            err = BodyTooLargeError(limit)
            await _send_error(send, err.status, err.message, str(err.code))
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLargeError as err:  # raised outside FastAPI's exception handlers
            if not started:
                await _send_error(send, err.status, err.message, str(err.code))
