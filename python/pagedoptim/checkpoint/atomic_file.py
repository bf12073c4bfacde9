"""Files that replace their final name all or nothing, and survive a crash of the writer.

`atomic_write(path)` hands out a file opened on a temporary name in the same directory
(so the rename cannot cross file systems). When the block ends without an exception the
bytes are flushed and fsynced, the file is renamed over `path`, and the directory is
fsynced so the rename itself is on disk. On any exception the temporary file is removed
and `path` is untouched. A writer killed before the rename (SIGKILL, power loss) leaves
`path` as it was and a temporary file named `.{name}.{pid}.{random}.pagedoptim-tmp`;
the next `atomic_write` of the same name removes such files whose writer process is gone.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import secrets
from typing import BinaryIO, Iterator, Union

TEMP_SUFFIX = ".pagedoptim-tmp"


def temporary_name(path: pathlib.Path) -> pathlib.Path:
    """A new temporary name for `path`: hidden, in its directory, naming the writer's pid."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _writer_pid(candidate: pathlib.Path, path: pathlib.Path) -> Union[int, None]:
    pattern = re.escape(f".{path.name}.") + r"(\d+)\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX)
    match = re.fullmatch(pattern, candidate.name)
    return int(match.group(1)) if match else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale_temporaries(path: Union[str, os.PathLike]) -> list[pathlib.Path]:
    """Removes the temporary files of `path` left by writers that died (their pid no longer
    runs) and returns them. Files of live writers, this process's included, are kept."""
    path = pathlib.Path(path)
    removed = []
    try:
        candidates = list(path.parent.glob(f".{glob_escape(path.name)}.*{TEMP_SUFFIX}"))
    except OSError:
        return removed
    for candidate in candidates:
        pid = _writer_pid(candidate, path)
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):  # another process cleaned it first
            candidate.unlink()
            removed.append(candidate)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def fsync_directory(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: Union[str, os.PathLike]) -> Iterator[BinaryIO]:
    """A binary file whose bytes replace `path` when the block ends without an exception
    (see the module docstring). Raises FileNotFoundError when the directory is missing."""
    path = pathlib.Path(path)
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(2, f"directory {directory} does not exist", str(directory))
    remove_stale_temporaries(path)
    temporary = temporary_name(path)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        # The temporary file is private (0600); give the result the mode a new file gets.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    # The rename is durable only once the directory entry is on disk.
    fsync_directory(directory)
