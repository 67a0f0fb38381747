"""Who the client is: the TCP peer, or, from a proxy the operator trusts, the address it forwarded.

uvicorn's own ``proxy_headers`` trusts ``X-Forwarded-For`` from 127.0.0.1 by default; ``icr serve``
turns that off, so a header is read only here and only from a peer in ``ICR_TRUSTED_PROXIES``:

* a peer that is not a trusted proxy is the client, whatever headers it sends (a local request
  carrying ``X-Forwarded-For: 8.8.8.8`` is still local, and a remote one cannot claim to be local);
* from a trusted proxy, the client is the right-most address of ``X-Forwarded-For`` that is not
  itself a trusted proxy (the addresses to its left were written by the client and prove nothing);
* a trusted proxy that forwarded no address leaves the client unknown: never local, so a same-host
  proxy that sets no header cannot make every remote client count as this machine.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from functools import lru_cache

from starlette.types import Scope

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
LOCAL_ADDRESSES = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class Client:
    address: str | None  # None: a trusted proxy that forwarded no address
    how: str  # how it was decided, for messages: "TCP peer", "X-Forwarded-For from proxy 10.0.0.2"

    @property
    def is_local(self) -> bool:
        return self.address is not None and (self.address in LOCAL_ADDRESSES or self.address == "localhost")


@lru_cache(maxsize=16)
def trusted_networks(proxies: tuple[str, ...]) -> tuple[IPNetwork, ...]:
    """``ICR_TRUSTED_PROXIES`` entries (addresses or CIDR blocks) as networks; ValueError naming a bad one."""
    out = []
    for entry in proxies:
        try:
            out.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"ICR_TRUSTED_PROXIES: {entry!r} is not an IP address or CIDR block (e.g. 10.0.0.0/8)"
            ) from None
    return tuple(out)


def _plain(host: str) -> str:
    return host.strip().removeprefix("::ffff:")  # an IPv4 peer on a dual-stack socket


def _trusted(host: str, networks: tuple[IPNetwork, ...]) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in networks)


def client_of(scope: Scope, proxies: tuple[str, ...]) -> Client:
    """The request's client (see the module's rules)."""
    peer = scope.get("client")
    host = _plain(peer[0]) if peer else None
    networks = trusted_networks(proxies)
    if host is None or not networks or not _trusted(host, networks):
        return Client(host, "TCP peer")
    forwarded = [
        _plain(part)
        for name, value in scope["headers"]
        if name == b"x-forwarded-for"
        for part in value.decode("latin-1").split(",")
        if part.strip()
    ]
    for address in reversed(forwarded):
        if not _trusted(address, networks):
            return Client(address, f"X-Forwarded-For from trusted proxy {host}")
    return Client(None, f"trusted proxy {host} forwarded no client address (X-Forwarded-For)")
