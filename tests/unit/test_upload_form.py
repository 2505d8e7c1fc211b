"""Pure logic: an upload's file name in RFC 5987's form (``filename*``) is read as its name."""

import pytest

from serve_app.stored.files_api import safe_filename
from serve_app.stored.upload_form import with_plain_filename


@pytest.mark.parametrize(
    "disposition, name",
    [
        (b"form-data; name=\"file\"; filename*=UTF-8''%E2%82%AC%20rates.jsonl", "€ rates.jsonl"),
        (b"form-data; name=\"file\"; filename*=utf-8'en'a%22b%0Ac.jsonl", 'a"b\nc.jsonl'),
        (b"form-data; name=\"file\"; filename*=iso-8859-1''caf%E9.jsonl", "café.jsonl"),
        (b'form-data; name="file"; FILENAME*="UTF-8\'\'q.jsonl"', "q.jsonl"),
    ],
)
def test_an_extended_name_becomes_the_plain_one(disposition, name):
    added = with_plain_filename(disposition)
    plain = added.rsplit(b'filename="', 1)[1][:-1].decode()
    assert safe_filename(plain) == safe_filename(name)


@pytest.mark.parametrize(
    "disposition",
    [
        b'form-data; name="file"; filename="kept.jsonl"; filename*=UTF-8\'\'other.jsonl',  # the plain one wins
        b'form-data; name="purpose"',  # a field
        b"form-data; name=\"file\"; filename*=UTF-8''%FF%FE.jsonl",  # not UTF-8: no name, as before
        b"form-data; name=\"file\"; filename*=x-unknown''a.jsonl",
        b"",
    ],
)
def test_anything_else_is_left_as_it_is(disposition):
    assert with_plain_filename(disposition) == disposition
