"""What crosses between front-end processes and the engine's process: framed binary
messages over a Unix socket. No torch, no pickle."""
