"""How opgate's own log lines (stderr) are formatted: each message on one line.

Messages quote what a request sent, percent-decoded (a path with ``%0A``, a user name): their
control characters are escaped as Python writes them, so a request cannot forge a line of
opgate's log. A traceback after a message keeps its own lines, and so does a message logged
with ``extra=KEEP_LINES``: one whose lines come from opgate's own files, not from a request
(policy errors, one ``file:line: message`` per line, as ``opgate check`` prints them).
"""

from __future__ import annotations

import logging

__all__ = ["KEEP_LINES", "OneLineFormatter"]

KEEP_LINES = {"opgate_keep_lines": True}  # extra= of a message whose lines are its own

# what a log message may not hold as it is: control characters but the tab (a CR or LF would
# start a line of the request's choosing), and the other line breaks a reader may split at
_ESCAPES = {i: f"\\x{i:02x}" for i in (*range(0x20), *range(0x7f, 0xa0)) if i != 0x09}
_ESCAPES.update({0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})


class OneLineFormatter(logging.Formatter):
    """Each message on one line (module docstring)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if message.isprintable() or getattr(record, "opgate_keep_lines", False):
            return super().formatMessage(record)
        record.message = message.translate(_ESCAPES)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message
