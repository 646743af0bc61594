"""KServe v2 over gRPC (grpcio).

grpcio's fork handlers are off: the server's children are spawned or exec'd, never forked
to go on using gRPC, and with them on, every child a model repository starts (fork, then
exec) printed "Other threads are currently calling into gRPC, skipping fork() handlers"
to the server's stderr. Set here, before any module of this package imports grpc."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
