"""A transport that records what a protocol writes, for driving serving/http's Connection
without a socket."""

from __future__ import annotations


class RecordingTransport:
    def __init__(self):
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass
