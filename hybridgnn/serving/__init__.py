"""Serving, by role: core/ (the engine), repository/ (model repositories), v2/ (the KServe
v2 service, transport-neutral), http/ and grpc/ (the transports), server.py (the one
assembly point) and lifecycle.py (signals and the drain)."""
