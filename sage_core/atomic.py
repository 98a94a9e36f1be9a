"""Files replaced whole: written to a file beside the target, then renamed over it.

A reader (another process, a resume after a kill) sees the old file or the new one, never half of one; a write
that fails (a full disk, a writer that raises) leaves the old file as it was and takes its temp file away. The temp
file is `.NAME.PID.tmp` beside the target: processes writing the same file at once (every rank writes spec.json)
each write their own, and it is made as any file is (umask), not with mkstemp's mode 600. No fsync: a rename is
atomic against readers and kills of the process, not against a power cut. With `replace=False` the file is put
at the target only where nothing is there by then (move_new): a file another process made there while this one
worked (an eval of minutes) is not written over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """The temp file to write `path`'s new content to (any writer: `df.to_parquet(tmp)`, `open(tmp, "w")`), renamed
    over `path` when the block ends; removed, and the error raised as it was, when the block raises. `replace`
    False: put at `path` only where no file is there when the block ends (FileExistsError where one is, that file
    as it was and the temp file removed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        if replace:
            os.replace(tmp, path)
        else:
            move_new(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text_atomic(path: str | os.PathLike, text: str, replace: bool = True) -> None:
    """Path.write_text (the locale's encoding, as it has), replacing `path` whole (`replace` as atomic_path's)."""
    with atomic_path(path, replace) as tmp:
        tmp.write_text(text)


def move_new(src: str | os.PathLike, path: str | os.PathLike) -> None:
    """`src` moved to `path` where no file is there, never over one (FileExistsError: that file and `src` as they
    were). A hard link made, then `src` removed: `path` appears whole or not at all, and os.link, unlike a rename,
    refuses a file that is there. Where the file system has no hard links (FAT, some network mounts) `path` is
    created exclusively (O_EXCL) and `src` copied into it: a reader may see it part-written meanwhile, and a copy
    that fails removes it."""
    try:
        os.link(src, path)
    except FileExistsError:
        raise
    except OSError:
        with open(src, "rb") as f:
            g = open(path, "xb")  # closed below, removed where the copy fails
            try:
                with g:
                    shutil.copyfileobj(f, g)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
    os.unlink(src)
