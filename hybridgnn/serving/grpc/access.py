"""gRPC's lines of the access log (serving/core/access.py): peer, `gRPC <method>`, the
status code's name, milliseconds from the call's handler starting to its end, and the
client's x-request-id metadata. Bytes are not known to a handler (grpcio frames them):
`-`. A server without --access-log gets no interceptor, so its calls cost nothing more."""

from __future__ import annotations

import asyncio
import time

import grpc

from hybridgnn.serving.core.access import (
    MAX_TARGET,
    enable_access_log,
    printable,
    write_line,
)


def peer_name(context) -> str:
    """host:port of the caller, from grpcio's "ipv4:host:port" / "ipv6:[host]:port"."""
    try:
        peer = context.peer() or "-"
    except Exception:  # grpcio raises for a call whose transport is gone
        return "-"
    return peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else printable(peer, 64)


def _code_name(context) -> str:
    try:
        code = context.code()
    except Exception:
        return "UNKNOWN"
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if code is None else str(code)


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each unary-unary method so its end writes one line: OK, the code it aborted
    with, UNKNOWN for a method that raised, CANCELLED for a call the client gave up."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = printable(details.method or "", MAX_TARGET)
        if handler is None or handler.unary_unary is None:
            return handler  # grpcio answers UNIMPLEMENTED itself
        behaviour = handler.unary_unary
        request_id = next((v for k, v in details.invocation_metadata or () if k == "x-request-id"), None)

        async def logged(request, context):
            began = time.monotonic()
            code = "OK"
            try:
                return await behaviour(request, context)
            except BaseException as exc:
                code = "CANCELLED" if isinstance(exc, asyncio.CancelledError) else _code_name(context)
                raise
            finally:
                write_line(peer_name(context), f"gRPC {method}", code, None, time.monotonic() - began,
                           request_id if isinstance(request_id, str) else None)

        return grpc.unary_unary_rpc_method_handler(logged, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def access_interceptors(enabled: bool | None) -> tuple:
    """grpc.aio.server's interceptors: the access log's when enabled, else none."""
    if not enabled:
        return ()
    enable_access_log()
    return (AccessInterceptor(),)
