"""A payload's bytes as its download lands them, for a decoder that starts before the last byte.

The download (an asyncio task) ``feed``s ranges in order; a decoder thread slices the object and
each slice blocks until its bytes have landed. A failed or cancelled download ``fail``s the buffer,
and every waiting or later slice raises ``DownloadFailed`` instead of waiting for bytes that will never
come. Knows nothing of patches or stores.
"""

from __future__ import annotations

import threading


class DownloadFailed(Exception):
    """Raised in a decoder thread whose bytes will never land; ``__cause__`` is the download's error
    (which the download's own task raises too: surface that one)."""


class ArrivingBytes:
    """An object of known ``size`` (a signed payload reference's), filled front to back."""

    def __init__(self, size: int) -> None:
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._filled = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def filled(self) -> int:
        """Bytes landed so far."""
        return self._filled

    def feed(self, data: bytes) -> None:
        """The next bytes of the object (the download's sink); more than ``size`` in all raises."""
        with self._cond:
            end = self._filled + len(data)
            if end > len(self._buf):
                raise ValueError(f"fed {end} bytes into an object of {len(self._buf)}")
            self._view[self._filled : end] = data
            self._filled = end
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The download ended before the object was whole: slices waiting or to come raise ``error``."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def __getitem__(self, key: slice) -> memoryview:
        """``object[start:stop]`` once those bytes have landed (blocking: decoder threads only)."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ArrivingBytes takes contiguous slices only")
        start, stop, _ = key.indices(len(self._buf))
        with self._cond:
            while self._filled < stop and self._error is None:
                self._cond.wait()
            if self._filled < stop:
                raise DownloadFailed(f"the download ended at byte {self._filled} of {len(self._buf)}") from self._error
        return self._view[start:max(start, stop)]

    def whole(self) -> memoryview:
        """Every byte: call once the download has returned."""
        if self._filled != len(self._buf):
            raise ValueError(f"{self._filled} of {len(self._buf)} bytes have landed")
        return self._view
