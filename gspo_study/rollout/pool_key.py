"""The rollout pool's shared secret and the authenticating front that makes a vLLM server on a network answer only
to whoever holds it (docs/RELIABILITY.md, "Who can drive a rollout pool").

A vLLM server with `VLLM_SERVER_DEV_MODE=1` (which our weight push needs: `/collective_rpc`) runs any worker method
for anyone who reaches its port, and vLLM's `--api-key` guards only its `/v1` routes. So a server meant for other
machines listens on loopback, and `AuthFront` — a small threaded HTTP proxy on the public address — forwards a
request only when it carries `Authorization: Bearer <key>` (compared in constant time), every route but `/health`
(which says only that the server is up). A refused request gets 401 and one line on stderr naming its route and
client, never the key it carried. The key comes from `$GSPO_STUDY_POOL_KEY` or the file `rollout.server.key_file`
names: never from a config value (configs are logged as MLflow params), never on a command line (`ps` shows it).
"""

from __future__ import annotations

import hmac
import http.client
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gspo_study.config import ConfigError

KEY_ENV = "GSPO_STUDY_POOL_KEY"
OPEN_PATHS = ("/health",)  # liveness only: the readiness probe of whoever starts a server
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_KEY_CHARS = 16  # a shared secret, not a password a person types


def pool_key(server) -> str | None:
    """The pool's key: `$GSPO_STUDY_POOL_KEY`, else the content of `server.key_file` (`rollout.server`), else None; a
    one-line error for a key file that cannot be read or a key too short to be a secret."""
    key = os.environ.get(KEY_ENV, "").strip()
    path = getattr(server, "key_file", "")
    if not key and path:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"rollout.server.key_file {path!r} cannot be read ({exc.strerror}); allowed: a readable "
                "file holding the pool's key"
            ) from None
    if not key:
        return None
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(
            f"the rollout pool's key is {len(key)} characters; allowed: at least {MIN_KEY_CHARS} (e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return key


def auth_header(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def is_loopback(host: str) -> bool:
    return host in LOOPBACK


class _Handler(BaseHTTPRequestHandler):
    front: AuthFront  # set on the subclass the front builds

    def do_GET(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def _allowed(self) -> bool:
        if self.path.split("?", 1)[0] in OPEN_PATHS:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.front.key}".encode())

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not self._allowed():
            self.front.refused += 1
            print(
                f"rollout pool: refused {self.command} {self.path.split('?', 1)[0]} from {self.client_address[0]} "
                "(no or wrong key)",
                file=sys.stderr,
                flush=True,
            )
            self._answer(401, b'{"error": "the rollout pool needs its key (Authorization: Bearer ...)"}')
            return
        upstream = http.client.HTTPConnection(*self.front.upstream, timeout=self.front.timeout)
        try:
            keep = ("content-type", "accept", "authorization")  # the key too: vLLM checks it again on /v1
            headers = {k: v for k, v in self.headers.items() if k.lower() in keep}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            self._answer(answer.status, answer.read(), answer.getheader("Content-Type", "application/json"))
        except OSError as exc:
            self._answer(502, f'{{"error": "the pool\'s server is not answering ({type(exc).__name__})"}}'.encode())
        finally:
            upstream.close()

    def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request would drown the server's own log; refusals are logged above


class AuthFront:
    """Listens on (host, port) and forwards to the server at `upstream` (host, port) the requests that carry the key.
    `serve()` blocks; `start()` serves from a daemon thread (tests, the suite); `refused` counts the refusals."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int], key: str, timeout: float = 600.0):
        if not key:
            raise ValueError("an authenticating front needs a key")
        self.key, self.upstream, self.timeout, self.refused = key, upstream, timeout, 0
        handler = type("Handler", (_Handler,), {"front": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.address = self.httpd.server_address[:2]

    def serve(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> AuthFront:
        threading.Thread(target=self.serve, daemon=True).start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
