"""``append_whole`` (serve_app/appends.py) on a disk that fills: a write refused
part-way leaves the file as it was, so the next append never lands after a cut line."""

from __future__ import annotations

import errno

import pytest
from small_disk import small_disk

from serve_app.appends import append_whole


def test_a_write_the_full_disk_refuses_part_way_leaves_the_file_as_it_was(tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        path = disk / "lines.jsonl"
        append_whole(path, b'{"a":1}\n', sync=True)
        with pytest.raises(OSError) as refused:
            append_whole(path, b'{"b":"' + b"x" * (200 << 10) + b'"}\n')  # more than the disk holds
        assert refused.value.errno in (errno.ENOSPC, errno.EDQUOT)
        assert path.read_bytes() == b'{"a":1}\n'
        append_whole(path, b'{"c":3}\n')
        assert path.read_bytes().splitlines() == [b'{"a":1}', b'{"c":3}']
