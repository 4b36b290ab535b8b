"""Who may call which route. SGLang's conventions plus trusted peers:

* `--api-key` (SGLang's) or `--api-key-file`: every route but /health*, /metrics, /live needs `Authorization: Bearer <key>`
  (or SGLang's `x-api-key: <key>` header).
* the admin token (`--admin-token-file`, or SGLang's `--admin-api-key`): the admin routes need it;
  as in SGLang, with no admin token the api key guards them instead, and with neither they are open.
* `--admin-peers CIDR,...`: a request whose TCP peer address is in one of these networks is admitted
  to every route without a key. RL frameworks send no Authorization on pause/abort/weights/memory;
  the operator passes the declared trainer peers here. The peer is the socket's address, never a
  forwarded header. With peers declared, an admin route refuses everyone else even with no key set.

A refusal changes nothing; the message names the route and what is missing, never a key."""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass, field
from typing import Optional

OPEN_PREFIXES = ("/health", "/metrics", "/live")   # probes and scrapers carry no secret (SGLang exempts them too)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_peers(spec: str) -> tuple[Network, ...]:
    """`--admin-peers`: comma-separated addresses or CIDRs; a bad entry raises ValueError naming it."""
    nets = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            nets.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"--admin-peers: {part!r} is not an IP address or CIDR") from None
    if not nets:
        raise ValueError("--admin-peers: no address given")
    return tuple(nets)


def _peer_ip(remote: Optional[str]):
    if not remote:
        return None
    try:
        ip = ipaddress.ip_address(remote.split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:   # a dual-stack socket's v4 client
        return ip.ipv4_mapped
    return ip


def _matches(headers, key: str) -> bool:
    scheme, _, given = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(_bytes(given.strip()), _bytes(key)):
        return True
    x = headers.get("x-api-key")
    return x is not None and hmac.compare_digest(_bytes(x.strip()), _bytes(key))


def _bytes(s: str) -> bytes:
    # aiohttp decodes header bytes that are not UTF-8 as lone surrogates: compare them, never raise
    return s.encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class AuthPolicy:
    admin_token: Optional[str] = field(default=None, repr=False)
    api_key: Optional[str] = field(default=None, repr=False)
    admin_peers: tuple[Network, ...] = ()

    def trusted(self, remote: Optional[str]) -> bool:
        ip = _peer_ip(remote)
        return ip is not None and any(ip.version == n.version and ip in n for n in self.admin_peers)

    def refusal(self, *, admin: bool, path: str, remote: Optional[str], headers) -> Optional[tuple[int, str]]:
        """None: admitted; else (status, why)."""
        if path.startswith(OPEN_PREFIXES) or self.trusted(remote):
            return None
        key = (self.admin_token or self.api_key) if admin else self.api_key
        what = "an admin route" if admin else "guarded by --api-key"
        if key is None:
            if admin and self.admin_peers:
                return 403, f"is {what}: peer {remote} is not in --admin-peers and no admin token is configured"
            return None
        if _matches(headers, key):
            return None
        sent = "Authorization" in headers or "x-api-key" in headers
        why = "wrong bearer token" if sent else "missing bearer token"
        needs = "admin token" if admin and self.admin_token else "api key"
        peers = " or a peer in --admin-peers" if self.admin_peers else ""
        return 401, f"is {what}: {why} (Authorization: Bearer <{needs}>{peers})"
