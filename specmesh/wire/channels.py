"""Client-side channels (SDK, router -> drafter/verifier): insecure or TLS,
optional client certificate (mutual TLS), fast reconnects and size limits.

Knows nothing about services or settings; imports only grpc.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import grpc

# Reconnect quickly after a peer restarts (the default backoff grows to minutes).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


def _pem(x) -> Optional[bytes]:
    if x is None or isinstance(x, bytes):
        return x
    return Path(x).read_bytes()


def channel_credentials(root_certificates=None, private_key=None, certificate_chain=None) -> grpc.ChannelCredentials:
    """TLS credentials; each argument is PEM bytes, a path, or None (system roots / no client cert)."""
    return grpc.ssl_channel_credentials(_pem(root_certificates), _pem(private_key), _pem(certificate_chain))


def channel(target: str, credentials: Optional[grpc.ChannelCredentials] = None, max_message_bytes: int = 64 << 20,
            aio: bool = False, options: Sequence = ()):
    opts = CHANNEL_OPTIONS + [("grpc.max_receive_message_length", max_message_bytes),
                              ("grpc.max_send_message_length", max_message_bytes)] + list(options)
    mod = grpc.aio if aio else grpc
    if credentials is None:
        return mod.insecure_channel(target, options=opts)
    return mod.secure_channel(target, credentials, options=opts)
