"""A framed message stream over a Unix socket (wire.py's frames), as an asyncio protocol:
each whole frame read is handed to `on_message(kind, id, payload)` in the read's own
callback, several per read under load (one system call carries many messages)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hybridgnn.serving.ipc.wire import FRAME, MAX_FRAME, WireError

log = logging.getLogger("hybridgnn.serving.ipc")


class Channel(asyncio.Protocol):
    """One end of a link. on_message(kind, rid, payload: memoryview) gets each frame
    (the memoryview is valid only during the call unless copied); on_lost(exc) once, when
    the link ends (EOF, an error, or a frame that does not decode); on_read() each read,
    before its frames, part of a frame too (the other end is writing)."""

    def __init__(self, on_message: Callable[[int, int, memoryview], None],
                 on_lost: Callable[[BaseException | None], None] | None = None,
                 on_read: Callable[[], None] | None = None):
        self.on_message = on_message
        self.on_lost = on_lost
        self.on_read = on_read
        self.transport: asyncio.Transport | None = None
        self.connected = asyncio.get_running_loop().create_future()
        self.closed = False
        self._buffer = bytearray()
        self._wanted = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.connected.done():
            self.connected.set_result(None)

    def send(self, data: bytes) -> bool:
        """Queue a frame; False when the link is closed (the frame is dropped)."""
        if self.closed:
            return False
        self.transport.write(data)
        return True

    def data_received(self, data: bytes) -> None:
        if self.on_read is not None:
            self.on_read()
        buf = self._buffer
        if buf:
            buf += data
            if len(buf) < self._wanted:
                return  # a large frame still arriving: append only (copying it per read is quadratic)
            view = memoryview(bytes(buf))
            buf.clear()
        else:
            view = memoryview(data)
        pos, end = 0, len(view)
        wanted = FRAME.size  # bytes the unfinished frame at pos needs, once known
        try:
            while end - pos >= FRAME.size:
                length, kind, rid = FRAME.unpack_from(view, pos)
                if not 5 <= length < MAX_FRAME:
                    raise WireError(f"frame length {length}")
                stop = pos + 4 + length
                if stop > end:
                    wanted = stop - pos
                    break
                self.on_message(kind, rid, view[pos + FRAME.size:stop])
                pos = stop
        except Exception as exc:
            log.error("IPC link broken: %r", exc)
            self.close(exc)
            return
        if pos < end:
            self._buffer += view[pos:]
            self._wanted = wanted

    def eof_received(self) -> bool:
        return False  # close our end too

    def connection_lost(self, exc) -> None:
        self._lost(exc)

    def close(self, exc: BaseException | None = None) -> None:
        if self.transport is not None:
            self.transport.close()
        self._lost(exc)

    def _lost(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.connected.done():
            self.connected.set_result(None)
        if self.on_lost is not None:
            self.on_lost(exc)


class Quiet:
    """Whether the other end of a link has stopped speaking (stopped, hung, its loop
    blocked) while its process lives on. The owner sets `heard = True` on every frame
    from it and calls tick(now) about once a period from its own loop; the other end
    speaks at least once a period (a keep-alive if it has nothing else to say).

    Quiet once limit_s of on-time ticks pass with nothing heard. A tick that comes late
    (more than three periods after the last) means this end stalled itself, with frames
    perhaps waiting unread, so the count starts again there: a process that was stopped
    and resumed never blames the other end for its own pause."""

    def __init__(self, period_s: float, limit_s: float):
        self.period_s = period_s
        self.limit_s = limit_s
        self.heard = True
        self.quiet = False
        self._silent_s = 0.0
        self._last: float | None = None

    def tick(self, now: float) -> bool:
        """Count the time since the last tick; True exactly when the other end just went quiet."""
        last, self._last = self._last, now
        if self.heard:
            self.heard = False
            self._silent_s = 0.0
            return False
        if last is None or now - last > 3 * self.period_s:
            self._silent_s = 0.0
            return False
        self._silent_s += now - last
        if self._silent_s >= self.limit_s and not self.quiet:
            self.quiet = True
            return True
        return False

    def spoke(self) -> bool:
        """Note a frame from the other end; True exactly when it had been quiet."""
        self.heard = True
        if self.quiet:
            self.quiet = False
            return True
        return False
