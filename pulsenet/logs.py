"""Logging set-up at the edge (CLI, node start-up): plain text for people, JSON lines for machines."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator

# Attributes every LogRecord has; anything else came from ``extra=`` and goes into the JSON line.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, ``extra=`` fields, exception text."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def setup_logging(verbosity: int = 0, fmt: str = "text") -> None:
    """Root logging at WARNING, INFO (-v) or DEBUG (-vv), as text or JSON lines on stderr."""
    level = logging.WARNING - 10 * min(verbosity, 2)
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


@contextlib.contextmanager
def suppressed(logger: logging.Logger, what: str) -> Iterator[None]:
    """``contextlib.suppress(Exception)`` for a teardown step that must not stop the steps after it,
    but never silent: what it swallowed is logged as a warning naming ``what`` and the exception.
    Cancellation (a BaseException) passes through; suppress ``asyncio.CancelledError`` beside it
    where a cancelled task is awaited on purpose."""
    try:
        yield
    except Exception as e:
        logger.warning("%s: %s: %s", what, type(e).__name__, e)
