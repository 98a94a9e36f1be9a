"""Files replaced whole: written to a file beside the target, then renamed over it.

A reader (another process, a resume after a kill) sees the old file or the new one, never half of one; a write
that fails (a full disk, a writer that raises) leaves the old file as it was and takes its temp file away. The temp
file is `.NAME.PID.tmp` beside the target: processes writing the same file at once (every rank writes spec.json)
each write their own, and it is made as any file is (umask), not with mkstemp's mode 600. No fsync: a rename is
atomic against readers and kills of the process, not against a power cut.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """The temp file to write `path`'s new content to (any writer: `df.to_parquet(tmp)`, `open(tmp, "w")`), renamed
    over `path` when the block ends; removed, and the error raised as it was, when the block raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Path.write_text (the locale's encoding, as it has), replacing `path` whole."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
