"""Every write failure names its file and a remedy that fits the errno (issue 27 review): a file too large for a
FAT32 stick is not "check the disk", a read-only mount is not "check the permissions"."""

from __future__ import annotations

import errno

import pytest

import luopan
from luopan._files import write_error
from luopan.errors import os_remedy
from luopan.repository.walio import io_error

CASES = [
    (errno.EFBIG, "ulimit -f"),
    (errno.EMFILE, "ulimit -n"),
    (errno.EROFS, "read-only"),
    (errno.EACCES, "owner and mode"),
    (errno.ENAMETOOLONG, "shorter path"),
    (errno.ENOSPC, "free space"),
    (errno.EIO, "check the disk"),
]


@pytest.mark.parametrize("code, remedy", CASES)
def test_each_errno_gets_its_own_remedy(code, remedy):
    assert remedy in os_remedy(code)
    log = io_error(OSError(code, "x"), "/data/log/00000001.seg", "writing to")
    assert isinstance(log, luopan.StorageError) and log.errno == code
    assert "/data/log/00000001.seg" in str(log) and remedy in str(log)
    assert ("I/O error" in str(log)) == (code == errno.EIO)
    placed = write_error(OSError(code, "x"), "/out/model.safetensors", placed=True)
    assert isinstance(placed, luopan.StorageError) and "/out/model.safetensors" in str(placed)
    assert remedy in str(placed)


def test_a_file_too_large_for_its_file_system_is_not_called_a_disk_error():
    err = write_error(OSError(errno.EFBIG, "File too large"), "/media/usb/model.safetensors", "nothing was written")
    assert isinstance(err, luopan.StorageError) and err.errno == errno.EFBIG
    assert "check the disk" not in str(err) and "I/O error" not in str(err)
    assert "/media/usb/model.safetensors" in str(err) and "FAT32" in str(err)
