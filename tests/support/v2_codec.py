"""The HTTP codec and the v2 validation in one call, as a request body goes through both:
what the codec and update tests feed bodies to."""

from __future__ import annotations

from hybridgnn.serving.http.codec import encode_infer_response as _encode
from hybridgnn.serving.http.codec import parse_infer, parse_update
from hybridgnn.serving.v2.inference import decode_infer
from hybridgnn.serving.v2.requests import decode_update
from hybridgnn.serving.v2.types import InferAnswer


def decode_infer_request(body: bytes, header_length: str | None, **limits):
    """The validated request of an inference body; .outputs maps each output to whether it
    is answered binary (as the HTTP answer encodes it)."""
    request, binary = parse_infer(body, header_length, "m", None)
    req = decode_infer(request, **limits)
    req.outputs = {n: binary if type(binary) is bool else binary.get(n, False) for n in req.outputs}
    return req


def encode_infer_response(model: str, request_id: str | None, tensors: dict, outputs: dict[str, bool],
                          model_version: str | None = None):
    answer = InferAnswer(model, model_version, request_id, [(n, tensors[n]) for n in outputs])
    return _encode(answer, dict(outputs))


def decode_update_request(body: bytes, header_length: str | None, **kw):
    return decode_update(parse_update(body, header_length), **kw)
