"""`BodyLimit`: an ASGI middleware that answers HTTP 413 to request bodies over a size, before
the app reads them whole, so no client can make the server buffer gigabytes."""

from __future__ import annotations

import json
from typing import Any

from kvfit.server.protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyLimit:
    """Wraps an ASGI `app`: an HTTP request whose body is over `limit` bytes gets 413 with an
    OpenAI error body naming `setting`. A declared `content-length` is checked up front; a
    chunked body is read up to the limit, then replayed to the app (memory: at most `limit`)."""

    def __init__(self, app: Any, limit: int, setting: str = "--max-request-body-bytes") -> None:
        self.app, self.limit, self.setting = app, limit, setting

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            # uvicorn holds the body to its content-length: only the declared size can be over.
            if declared.isdigit() and int(declared) > self.limit:
                await self._reject(send)
            else:
                await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._reject(send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what comes after the body (a disconnect)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, send: Any) -> None:
        message = (f"the request body is over {self.limit} bytes; send less or raise "
                   f"{self.setting}")
        payload = json.dumps(error_body(message, "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
