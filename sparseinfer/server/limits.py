"""What a request may be: how big its body is and how long it takes to arrive, how many stop
strings it sets and how long they are, how long its prompt is before tokenizing, how long the
chat template may take to render it, and which Host and Origin headers it may carry.

The Host check stops DNS rebinding (a web page whose own name now resolves to this machine
reading the server as if same-origin); the Origin check stops other sites' pages from driving
the server from a visitor's browser. Both accept what a local client or the built-in chat page
sends, and options widen them.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')  # possessive: linear on any input
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_PORTS = {"http": "80", "https": "443"}


@dataclass(frozen=True)
class Limits:
    """The server's limits on a request; each is an option of `sparseinfer serve`."""

    max_body_bytes: int = 8 << 20          # --max-body (MiB); 413 beyond
    max_json_values: int | None = None     # --max-json-values; None: 8 x context size + 4096; 413 beyond
    body_timeout_s: float = 30.0           # --body-timeout: the whole body must arrive in this time; 408 after
    max_stops: int = 16                    # --max-stops: stop strings per request
    max_stop_chars: int = 256              # --max-stop-chars: characters per stop string
    max_prompt_chars: int | None = None    # --max-prompt-chars; None: context size x the longest token
    chat_template_timeout_s: float = 5.0   # --chat-template-timeout: rendering time of one conversation
    allowed_hosts: tuple[str, ...] = ()    # --allowed-hosts: Host names beyond loopback ones; "*": any
    allowed_origins: tuple[str, ...] = ()  # --allowed-origins: browser origins beyond the server's own; "*": any

    def prompt_chars(self, ctx_size: int, longest_token_chars: int) -> int:
        """Characters a prompt may have before it is tokenized: more cannot fit in the context,
        as no token stands for more characters than the longest one."""
        return self.max_prompt_chars or ctx_size * max(longest_token_chars, 1)

    def json_values(self, ctx_size: int) -> int:
        """JSON values a body may hold: parsing costs memory per value, far more than the bytes
        of a small one; a request that fits the context has about one per token at most."""
        return self.max_json_values or 8 * ctx_size + 4096


def count_json_values(body: bytes, bound: int | None = None) -> int:
    """About how many values a JSON text holds (commas and opening brackets outside strings),
    without parsing it. With `bound`, a count at or under it may include those inside strings
    (counting them is free; leaving them out takes a pass over the strings)."""
    def structural(a: int = 0, b: int | None = None) -> int:
        return body.count(b",", a, b) + body.count(b"[", a, b) + body.count(b"{", a, b)

    n = structural()
    if bound is not None and n <= bound:
        return n
    for m in _JSON_STRING.finditer(body):  # one match at a time: no copy of the body
        n -= structural(*m.span())
    return n


def split_list(value: str | None) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): a comma list option."""
    return tuple(x.strip() for x in (value or "").split(",") if x.strip())


def host_name(host: str) -> str:
    """The name of a Host header, lower case, without port or trailing dot: '[::1]:8080' -> '::1'."""
    h = host.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    if h.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        h = h.split(":")[0]
    return h.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """Loopback names, *.localhost, IP addresses (a page cannot rebind an address), and `allowed`
    (names; "*" allows all). A request without Host (HTTP/1.0) is not a browser's, and passes."""
    if not host or "*" in allowed:
        return True
    name = host_name(host)
    return (name in LOOPBACK_NAMES or name.endswith(".localhost") or _is_ip(name)
            or name in {host_name(a) for a in allowed})


def _origin_netloc(origin: str) -> str | None:
    """'http://Example.com:80' -> 'example.com'; None for 'null' and anything without a scheme."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or not rest:
        return None
    netloc = rest.split("/")[0]
    port = DEFAULT_PORTS.get(scheme)
    return netloc[: -len(port) - 1] if port and netloc.endswith(":" + port) else netloc


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """No Origin (not a cross-site browser request), the server's own origin (the page it served:
    the Origin names the same host and port as the Host header), or one of `allowed` ("*": any)."""
    if origin is None or "*" in allowed:
        return True
    if origin.strip().lower().rstrip("/") in {a.lower().rstrip("/") for a in allowed}:
        return True
    netloc = _origin_netloc(origin)
    if netloc is None or not host:
        return False
    h = host.strip().lower()
    return netloc in (h, h.rsplit(":", 1)[0] if h.endswith((":80", ":443")) else h)
