"""Exporter process: a file appended to in whole lines (the span file, the access log).

Each ``append`` is one batch of complete lines, written unbuffered: a write that
fails (a full disk) must not stay in a buffer, to go out glued to the next batch.
What part of a failed batch did reach the file is cut off again, so every line
stays a whole JSON document, and the error is raised for the caller to count.

Hazard: several workers' exporter processes append to the same file. The cut is
made only when the file grew by less than this batch, as a torn batch of ours
would leave it; a file that grew more holds lines of others, and the torn line stays.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path


class LineFile:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab", buffering=0)
        self._cut_back = True

    @classmethod
    def stdout(cls) -> "LineFile":
        """The process's stdout (the proxy's), never cut back: it is not ours alone."""
        lines = cls.__new__(cls)
        lines.path = "stdout"
        lines._file = open(sys.stdout.fileno(), "wb", buffering=0, closefd=False)
        lines._cut_back = False
        return lines

    def append(self, data: bytes) -> None:
        """Write all of ``data``, or raise OSError with none of it left in a regular file."""
        start = self._size() if self._cut_back else None
        view = memoryview(data)
        try:
            while view:
                written = self._file.write(view)
                if written is None:  # a non-blocking descriptor that is full
                    raise BlockingIOError(errno.EAGAIN, "the output would block")
                view = view[written:]
        except OSError:
            if start is not None:
                self._cut_back_to(start, len(data))
            raise

    def close(self) -> None:
        self._file.close()

    def _size(self) -> int | None:
        try:
            return os.fstat(self._file.fileno()).st_size
        except OSError:
            return None

    def _cut_back_to(self, start: int, batch: int) -> None:
        size = self._size()
        if size is not None and start < size < start + batch:
            try:
                os.ftruncate(self._file.fileno(), start)
            except OSError:  # a device or a pipe: nothing to cut
                pass
