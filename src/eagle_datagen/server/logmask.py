"""eagle-datagen log masker: copies a launched server's output into its log with every secret replaced by ``***``.

SGLang prints its resolved server args at start-up (``api_key='…'``, ``admin_api_key='…'``), so its output
reaches ``server.log`` only through this process:

    python -I logmask.py SECRETS_FD IDLE_S LABEL    stdin: the server's stdout+stderr; stdout: the log

The secrets come on the inherited pipe ``SECRETS_FD`` (NUL-separated bytes, read to its end before anything
else), never on a command line (``ps`` shows command lines to every local user). ``LABEL`` (the log's path)
is only there so ``ps`` tells which log a masker writes.

It is a process of its own, in its own session, and not a thread of eagle-datagen: a ``kill -9`` of
eagle-datagen leaves it running, so the server neither dies of SIGPIPE nor loses its last lines while the
reaper stops it. It exits when every writer of the pipe is gone (the whole server process group).

What is written is the input byte for byte, except each secret (longest first where two overlap). Output
goes out a whole line at a time (``\\n`` or ``\\r``, so progress bars work); a partial line goes out after
``IDLE_S`` without input, or at the end. Bytes that may be the start of a secret cut across two writes are
held back until the next write decides; at the end such a tail of :data:`MIN_TAIL` bytes or more is masked
as well. Non-UTF-8 bytes are copied as they are: nothing is decoded.

Standard library only: ``-I`` keeps this checkout, PYTHONPATH and user site-packages out of it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
from collections.abc import Sequence

MASK = b"***"
#: A held-back tail (the start of a secret when the input ends) this long or longer is masked too.
MIN_TAIL = 4
#: A line longer than this goes out without waiting for its end.
MAX_HELD_LINE = 1 << 16
READ_SIZE = 1 << 16


class Masker:
    """Streaming replacement of ``secrets`` by :data:`MASK`: what :meth:`feed` and :meth:`finish` return,
    joined, is the whole input with every secret replaced (leftmost, longest first), however the input was
    cut into pieces; only a secret cut off by the end of the input is masked by :meth:`finish` instead."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        self.forms = sorted({s for s in secrets if s}, key=len, reverse=True)
        self._pattern = re.compile(b"|".join(re.escape(s) for s in self.forms)) if self.forms else None
        self._longest = len(self.forms[0]) if self.forms else 0
        self._raw = b""

    def feed(self, data: bytes) -> bytes:
        """The masked bytes that ``data`` (after what was held back) decides; the rest is held back."""
        if self._pattern is None:
            return data
        raw = self._raw + data
        pending = self._pending(raw)
        out: list[bytes] = []
        pos = 0
        while True:
            # The first position from pos whose outcome depends on bytes not yet read.
            stop = next((k for k in pending if k >= pos), len(raw))
            match = self._pattern.search(raw, pos)
            if match is None or match.start() >= stop:
                out.append(raw[pos:stop])
                self._raw = raw[stop:]
                return b"".join(out)
            # Final: no longer secret can start at match.start() (it would make that position pending).
            out += (raw[pos : match.start()], MASK)
            pos = match.end()

    def finish(self) -> bytes:
        """What is still held back, at the end of the input (masked when it is a long enough secret start)."""
        raw, self._raw = self._raw, b""
        return MASK if len(raw) >= MIN_TAIL else raw

    @property
    def held(self) -> int:
        """How many bytes are held back."""
        return len(self._raw)

    def _pending(self, raw: bytes) -> list[int]:
        """Positions ``k`` where ``raw[k:]`` is a proper prefix of a secret (ascending)."""
        n = len(raw)
        return [
            k
            for k in range(max(0, n - self._longest + 1), n)
            if any(len(s) > n - k and s.startswith(raw[k:]) for s in self.forms)
        ]


def line_end(out: bytes) -> int:
    """The length of ``out``'s whole lines (up to its last ``\\n`` or ``\\r``)."""
    return max(out.rfind(b"\n"), out.rfind(b"\r")) + 1


def write_all(fd: int, data: bytes) -> None:
    """Writes ``data``; a write error (a full disk) drops it: the server must not stall or die of it."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass


def read_secrets(fd: int) -> list[bytes]:
    chunks = []
    while chunk := os.read(fd, READ_SIZE):
        chunks.append(chunk)
    os.close(fd)
    return [s for s in b"".join(chunks).split(b"\0") if s]


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str]) -> int:
    # A Ctrl-C or hang-up is not ours to act on (the owner or the reaper ends the server; EOF ends us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    masker = Masker(read_secrets(int(argv[1])))
    idle_s = float(argv[2])
    out = b""
    try:
        while True:
            if out and not select.select([0], [], [], idle_s)[0]:
                write_all(1, out)  # a partial line (a progress bar) after a quiet moment
                out = b""
                continue
            data = os.read(0, READ_SIZE)
            if not data:
                break
            out += masker.feed(data)
            cut = len(out) if len(out) >= MAX_HELD_LINE else line_end(out)
            if cut:
                write_all(1, out[:cut])
                out = out[cut:]
    finally:
        write_all(1, out + masker.finish())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
