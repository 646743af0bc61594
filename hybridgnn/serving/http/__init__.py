"""KServe v2 over HTTP/1.1: the server and its connections (server.py, protocol.py), the
REST routes (api.py) and the JSON and binary-tensor codec (codec.py)."""
