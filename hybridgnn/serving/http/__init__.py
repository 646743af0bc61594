"""The HTTP layer: the KServe v2 API (api.py), its codec (codec.py) and the HTTP/1.1 protocol server on llhttp (protocol.py)."""
