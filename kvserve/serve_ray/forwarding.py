"""What the ingress hands a model replica, and how the replica's answer comes back: an HTTP request as
plain data, answered by the ASGI messages of kvserve's own OpenAI app (status and headers first, then
body chunks), so the replica runs exactly the request handling of the single-engine server."""
from __future__ import annotations

from dataclasses import dataclass, field

# Each response names the replica that served it (for logs, debugging and the scaling tests).
REPLICA_HEADER = "x-kvserve-replica"


@dataclass
class ForwardedRequest:
    method: str
    path: str
    body: bytes = b""
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def asgi_scope(self) -> dict:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
            "root_path": "", "query_string": self.query_string, "headers": list(self.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        }
