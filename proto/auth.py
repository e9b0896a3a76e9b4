"""Token authentication of every coordinator call (invariant 4: no unauthenticated control)."""

from __future__ import annotations

import hmac

import grpc

TOKEN_METADATA_KEY = "ringmaster-token"


def call_metadata(secret: str):
    """The metadata a rank attaches to each call."""
    return ((TOKEN_METADATA_KEY, secret),)


REFUSAL = ("missing or wrong ringmaster job token: only ranks of this job may call "
           "the coordinator (they receive the token in RINGMASTER_SECRET)")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with ``UNAUTHENTICATED``, every call whose token is missing or wrong.

    The comparison is constant-time; the expected token is never logged or echoed.
    """

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("the coordinator needs a non-empty job secret (RINGMASTER_SECRET)")
        self._secret = secret.encode()

    async def intercept_service(self, continuation, handler_call_details):
        offered = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        handler = await continuation(handler_call_details)
        if hmac.compare_digest(offered.encode(), self._secret):
            return handler
        return _refusing_handler(handler)


async def _refuse(request_or_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _refusing_handler(handler):
    """A handler of the same streaming kind as ``handler`` that refuses the call."""
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)
