"""Files replaced whole (sage_core.atomic): the old file kept byte for byte by a write that fails, no temp file left,
one temp file per process."""

from __future__ import annotations

import errno
import os

import pytest

from sage_core.atomic import atomic_path, write_text_atomic

OLD = b"old \xc3\xa9 table\n\x00 kept byte for byte"


def test_write_text_atomic_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "spec.json"
    path.write_bytes(OLD)
    write_text_atomic(str(path), '{"a": 1}\n')  # a str, as os.path.join gives
    assert path.read_text() == '{"a": 1}\n' and [p.name for p in tmp_path.iterdir()] == ["spec.json"]


@pytest.mark.parametrize("error", [ValueError("cannot be serialised"), OSError(errno.ENOSPC, "No space left on device"),
                                   KeyboardInterrupt()])
def test_a_writer_that_raises_midway_leaves_the_old_file_and_no_temp_file(tmp_path, error):
    """Half the new content written, then the writer raises (a full disk, a value it cannot write, Ctrl-C): the
    error comes out as it was (cli's disk-full handling reads its errno), the old file is there byte for byte and
    the half-written temp file is gone."""
    path = tmp_path / "eval.parquet"
    path.write_bytes(OLD)
    with pytest.raises(type(error)) as raised, atomic_path(path) as tmp:
        tmp.write_bytes(b"PAR1 half a parquet")
        raise error
    assert raised.value is error
    assert path.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["eval.parquet"]


def test_a_write_that_fails_with_no_old_file_leaves_the_folder_empty(tmp_path):
    with pytest.raises(OSError), atomic_path(tmp_path / "rows.json") as tmp:
        with tmp.open("w") as f:
            f.write("[1, 2")
            raise OSError(errno.EIO, "Input/output error")
    assert list(tmp_path.iterdir()) == []


def test_a_rename_that_fails_leaves_the_target_and_no_temp_file(tmp_path):
    """The rename itself refused (the target is a folder): the folder as it was, the temp file removed."""
    (tmp_path / "out.json").mkdir()
    (tmp_path / "out.json" / "inside").write_bytes(OLD)
    with pytest.raises(OSError):
        write_text_atomic(tmp_path / "out.json", "new")
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    assert (tmp_path / "out.json" / "inside").read_bytes() == OLD


def test_processes_writing_one_file_at_once_each_write_their_own_temp_file(tmp_path, monkeypatch):
    """Every rank writes spec.json: the second process starting its write while the first is midway does not cut
    the first's temp file short (a shared temp name would), and the file ends whole, as the last rename left it."""
    path = tmp_path / "spec.json"
    monkeypatch.setattr(os, "getpid", lambda: 101)
    with atomic_path(path) as first, first.open("w") as f:
        f.write('{"rank": 0, ')
        monkeypatch.setattr(os, "getpid", lambda: 102)
        write_text_atomic(path, '{"rank": 1}')
        assert path.read_text() == '{"rank": 1}'
        f.write('"whole": true}')
    assert first.name == ".spec.json.101.tmp"
    assert path.read_text() == '{"rank": 0, "whole": true}' and [p.name for p in tmp_path.iterdir()] == ["spec.json"]


def test_the_file_is_made_as_any_file_is_not_private(tmp_path):
    """Made with the umask's mode (a table, a hints file others read), not mkstemp's 600."""
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "t.json", "[]")
    finally:
        os.umask(old)
    assert (tmp_path / "t.json").stat().st_mode & 0o777 == 0o644


def _no_links(src, dst, **kw):  # os.link on a file system without hard links (FAT)
    raise OSError(errno.EPERM, os.strerror(errno.EPERM))


@pytest.mark.parametrize("hard_links", [True, False])
def test_replace_false_puts_the_file_only_where_none_was_made_meanwhile(tmp_path, monkeypatch, hard_links):
    """`replace=False` (sage eval --output without --force): a file another process made at the path while the
    content was written stays as it was, FileExistsError says so and no temp file is left; where none was made the
    file is written whole. Also on a file system without hard links (os.link refused: FAT), created exclusively."""
    if not hard_links:
        monkeypatch.setattr(os, "link", _no_links)
    path = tmp_path / "eval.json"
    with pytest.raises(FileExistsError), atomic_path(path, replace=False) as tmp:
        tmp.write_text("this eval's table")
        path.write_bytes(OLD)  # another process, meanwhile
    assert path.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["eval.json"]
    write_text_atomic(tmp_path / "new.json", "this eval's table", replace=False)
    assert (tmp_path / "new.json").read_text() == "this eval's table"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "new.json"]


def test_replace_false_without_hard_links_removes_a_copy_that_fails(tmp_path, monkeypatch):
    """No hard links, and the copy into the file made exclusively fails (the disk filled): neither the part-written
    file nor the temp file is left, and the error comes out as it was."""
    import shutil

    def disk_full(src, dst, *a):
        dst.write(b"PAR1 half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "link", _no_links)
    monkeypatch.setattr(shutil, "copyfileobj", disk_full)
    with pytest.raises(OSError) as raised:
        write_text_atomic(tmp_path / "eval.json", "this eval's table", replace=False)
    assert raised.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []
