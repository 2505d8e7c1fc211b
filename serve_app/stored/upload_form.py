"""Reading an upload's multipart form, with the file name in either of the forms clients send it."""

from __future__ import annotations

import codecs
import re
from contextlib import aclosing
from urllib.parse import unquote

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

# RFC 5987's extended value: charset'language'percent-encoded bytes.
_EXTENDED = re.compile(rb"""filename\*\s*=\s*"?([\w!#$%&+^`{}~-]*)'[^']*'([^";]*)"?""", re.IGNORECASE)
_PLAIN = re.compile(rb"""(^|;)\s*filename\s*=""", re.IGNORECASE)


def with_plain_filename(disposition: bytes) -> bytes:
    """A part's Content-Disposition with ``filename="…"`` added when it names its file
    only as RFC 5987's ``filename*=UTF-8''…``. RFC 7578 §4.2 forbids that form in
    multipart/form-data and python-multipart ignores it, so such a part would be read
    as a text field, yet curl scripts and some HTTP libraries send it. The plain
    form, when given, is kept as it is."""
    extended = _EXTENDED.search(disposition)
    if extended is None or _PLAIN.search(disposition):
        return disposition
    charset = extended.group(1).decode("ascii") or "utf-8"
    try:
        codecs.lookup(charset)
        name = unquote(extended.group(2).decode("ascii"), encoding=charset, errors="strict")
    except (LookupError, UnicodeDecodeError):
        return disposition  # an unknown charset or bad bytes: no file name, as the RFC form
    # As the HTML form escapes a filename ('"', CR and LF; files_api.safe_filename undoes it).
    escaped = name.replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")
    return disposition + b'; filename="' + escaped.encode("utf-8") + b'"'


class _UploadParser(MultiPartParser):
    def on_headers_finished(self) -> None:
        part = self._current_part
        part.content_disposition = with_plain_filename(part.content_disposition or b"")
        super().on_headers_finished()


async def read_upload_form(request: Request, *, max_files: int, max_fields: int) -> FormData:
    """The request's multipart form (its files spooled to disk as they arrive).
    Raises ``MultiPartException`` for a body that is no such form."""
    async with aclosing(request.stream()) as stream:
        return await _UploadParser(request.headers, stream, max_files=max_files, max_fields=max_fields).parse()


__all__ = ["MultiPartException", "read_upload_form", "with_plain_filename"]
