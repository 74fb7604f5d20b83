"""Gates in front of the HTTP app: the API key's sanity, the Host allow-list (DNS rebinding), and the last-resort
handler that answers an unexpected exception with an error id, never its text."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Iterable

from starlette.datastructures import Headers

from .errors import APIError

log = logging.getLogger("tlaloc_jax.serve.http")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# A Host header: a name or IPv4 address, or a bracketed IPv6 address, and an optional port.
_HOST_HEADER = re.compile(r"(\[[0-9a-f:.]+\]|[^:\[\]/@\s]+)(?::\d*)?")


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot serve as an API key (every request would be refused), or None."""
    if not key:
        return "is empty"
    if key != key.strip():
        return "has spaces around it (a key in an Authorization header is read without them, so none would match)"
    return None


def host_name(header: str) -> str | None:
    """A Host header's host, lower-case ('LocalHost:8000' -> 'localhost', '[::1]:80' -> '[::1]'); None if malformed."""
    m = _HOST_HEADER.fullmatch(header.strip().lower())
    return m.group(1) if m else None


def allowed_host_names(hosts: Iterable[str]) -> frozenset[str]:
    """Host allow-list entries, lower-case; ValueError naming those that are not a bare host ("*": any)."""
    names = frozenset(h.strip().lower() for h in hosts)
    bad = sorted(h for h in names if h != "*" and host_name(h) != h)
    if bad:
        raise ValueError(f"allowed hosts {', '.join(map(repr, bad))} are not host names (a name, an IPv4 address or "
                         "a bracketed IPv6 address, without a port)")
    return names


def new_error_id() -> str:
    return uuid.uuid4().hex[:12]


class HostAllowList:
    """ASGI middleware: answer 421 to a Host header outside `hosts` (a page on another site whose name resolves
    to this address, DNS rebinding, sends its own name)."""

    def __init__(self, app, hosts: frozenset[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            if host_name(host) not in self.hosts:
                err = APIError(421, f"Host {host!r} is not a host this server answers for (allowed: "
                                    f"{', '.join(sorted(self.hosts))}; the server's --allowed-hosts adds more).",
                               code="invalid_host")
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


class InternalErrors:
    """ASGI middleware: an exception no handler answered is logged once, with an id, and answered 500 with that
    id only (its text may name paths on disk). Starlette's last-resort handler would log it and re-raise it to
    the server, which logs it again; an answer already under way (a stream) is cut off."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception:  # noqa: BLE001 - logged here, answered without its text
            error_id = new_error_id()
            log.exception("internal error (id %s) in %s %s", error_id, scope["method"], scope["path"])
            if not started:
                err = APIError(500, f"internal error (id {error_id}); the server log has the details",
                               type="internal_server_error")
                await err.response()(scope, receive, send)
