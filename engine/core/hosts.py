"""Whose request is it: the Host and Origin checks that the app (app/guard.py) and
`edgetune serve` (engine/run/serve.py) apply to every request. No web framework here:
plain names and headers in, a one-line refusal or None out.

- Host: only a name the server is addressed by (localhost, the host it binds, a name
  given with --allow-host) or an IP address. A web page that rebinds its own domain to
  127.0.0.1 (DNS rebinding) sends its domain as Host, so it is refused; an IP address
  involves no DNS, so no page can borrow it.
- Origin: a request that can change something (POST, PUT, PATCH, DELETE, a websocket)
  sent by a page of another site is refused, so no other page drives the server from the
  browser of someone who has it open.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

WILDCARDS = ("0.0.0.0", "::", "")  # bound to every interface: the bound host is no name to check against
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")


def host_name(netloc: str) -> str | None:
    """'Example.COM:7860' -> 'example.com', '[::1]:7860' -> '::1'; None when unreadable."""
    try:
        name = urlsplit("//" + netloc).hostname
    except ValueError:
        return None
    return (name or "").rstrip(".") or None


def allowed_hosts(bound: str, extra: list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """The names a request's Host may carry (IP addresses are always accepted, see
    host_allowed): localhost, the bound host, and the names the user gave."""
    names = {"localhost", *(n.lower().rstrip(".") for n in extra)}
    if bound not in WILDCARDS:
        names.add(bound.lower().strip("[]"))
    return frozenset(names)


def host_allowed(name: str | None, names: frozenset[str]) -> bool:
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in names


class HostCheck:
    """The checks for a server bound to `bound`, with the names given to its `command`'s
    --allow-host (`allow`); `what` it is, in the refusal."""

    def __init__(self, bound: str, allow: list[str] | tuple[str, ...] = (), command: str = "edgetune ui",
                 what: str = "this app"):
        self.hosts = allowed_hosts(bound, allow)
        self.allow = frozenset(n.lower().rstrip(".") for n in allow)
        self.command, self.what = command, what

    def foreign(self, host: str, origin: str | None, changes: bool) -> str | None:
        """Why a request comes from elsewhere, or None. `host`, `origin`: its headers;
        `changes`: a method that can change something, or a websocket."""
        if not host_allowed(host_name(host), self.hosts):
            return (f"refused: Host '{host}' is not an address of {self.what} (localhost, an IP address, "
                    f"or a name given to `{self.command} --allow-host`)")
        if origin is not None and changes:
            try:
                netloc = urlsplit(origin).netloc.lower()
            except ValueError:
                netloc = ""
            # The page's own origin, or a name the user allowed (a reverse proxy in front).
            if not netloc or (netloc != host.lower() and host_name(netloc) not in self.allow):
                return f"refused: a request from the page of another site ({origin})"
        return None
