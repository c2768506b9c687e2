"""Reading and writing the files of a run dir or a checkpoint without trusting what is already there.

Run dirs live on shared filesystems, where anyone (or an earlier, killed run) may have left a symlink to a file
elsewhere, a FIFO, a folder, a huge file or a deeply nested JSON under a name dsaflow uses. So:

  * every read of a file dsaflow did not just write goes through `open_regular` (`read_bytes`, `read_text`,
    `read_json`): regular files only, opened with O_NOFOLLOW (a final symlink is refused) and O_NONBLOCK (a FIFO is
    refused instead of hanging), optionally required to lie directly inside a given folder, bounded in size, JSON
    bounded in nesting depth;
  * every write of a whole file goes through `atomic_write`: an exclusive temporary file (O_CREAT|O_EXCL|O_NOFOLLOW,
    so a planted `*.tmp` link is never followed), fsync, then a rename over the target (a link at the target is
    replaced, never written through); appends go through `append_text` (O_APPEND|O_NOFOLLOW on a regular file).

Failures are `UnsafeFile` (a PlanError: one paragraph, exit status 2) naming the path and what is wrong with it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Callable, Optional, Union

from dsaflow.errors import PlanError

MAX_TEXT_BYTES = 64 << 20  # config.yaml, plan.json, manifests, prompt files: far below this
MAX_JSON_DEPTH = 64
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

PathLike = Union[str, os.PathLike]


class UnsafeFile(PlanError):
    """A file that is missing, not a regular file, outside its folder, too large or malformed."""


class MissingFile(UnsafeFile):
    """The file does not exist (callers often word this case themselves)."""


def kind_of(mode: int) -> str:
    """'a folder', 'a FIFO (named pipe)', ... for an lstat mode."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def explain_os_error(exc: OSError) -> str:
    """A short phrase for the OS errors a user can fix."""
    return {
        errno.ENOENT: "does not exist",
        errno.EACCES: "is not readable or writable by you (permission denied)",
        errno.EPERM: "is not permitted",
        errno.ENAMETOOLONG: "is a path too long for this filesystem",
        errno.ENOSPC: "could not be written: the disk is full",
        errno.EDQUOT: "could not be written: disk quota exceeded",
        errno.EROFS: "is on a read-only filesystem",
        errno.ELOOP: "is a symbolic link (never followed)",
        errno.ENOTDIR: "has a file where a folder should be",
        errno.EISDIR: "is a folder",
    }.get(exc.errno, exc.strerror or str(exc))


def _check_inside(path: Path, folder: Optional[PathLike]) -> None:
    if folder is None:
        return
    try:
        inside = path.parent.resolve(strict=True) == Path(folder).resolve(strict=True)
    except OSError:
        inside = False
    if not inside or path.name in ("", ".", ".."):
        raise UnsafeFile(f"{path} is not a file directly inside {folder}; refused")


def open_regular(path: PathLike, inside: Optional[PathLike] = None, max_bytes: Optional[int] = MAX_TEXT_BYTES) -> int:
    """A read-only fd of `path`, which must be a regular file (not a link, FIFO or folder), directly inside `inside`
    when given, and at most `max_bytes` long. Never blocks. The caller closes the fd."""
    path = Path(path)
    _check_inside(path, inside)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise MissingFile(f"{path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP or (os.path.islink(path)):
            raise UnsafeFile(
                f"{path} is a symbolic link; dsaflow never follows links in a run dir or checkpoint (refused)"
            ) from None
        raise UnsafeFile(f"{path} {explain_os_error(exc)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path} is {kind_of(st.st_mode)}, not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFile(f"{path} is {st.st_size} bytes, more than the {max_bytes} such a file may have")
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: PathLike, inside: Optional[PathLike] = None, max_bytes: Optional[int] = MAX_TEXT_BYTES) -> bytes:
    fd = open_regular(path, inside, max_bytes)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except OSError as exc:
        raise UnsafeFile(f"{path} could not be read ({explain_os_error(exc)})") from None
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsafeFile(f"{path} grew past {max_bytes} bytes while being read")
    return data


def read_text(path: PathLike, inside: Optional[PathLike] = None, max_bytes: Optional[int] = MAX_TEXT_BYTES) -> str:
    try:
        return read_bytes(path, inside, max_bytes).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeFile(f"{path} is not UTF-8 text (byte {exc.start})") from None


def json_depth_ok(obj, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """True when `obj` (parsed JSON) nests lists/dicts at most `max_depth` deep (iterative: no recursion)."""
    todo = [(obj, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, dict)):
            if d > max_depth:
                return False
            todo.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return True


def parse_json(text: Union[str, bytes], what: str, max_depth: int = MAX_JSON_DEPTH):
    """json.loads with bounds: nesting depth, and the errors of hostile input (huge integers, deep nesting) turned
    into UnsafeFile naming `what`."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise UnsafeFile(f"{what} nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnsafeFile(f"{what} is not valid JSON ({str(exc)[:120]})") from None
    if not json_depth_ok(obj, max_depth):
        raise UnsafeFile(f"{what} nests deeper than {max_depth} levels")
    return obj


def read_json(
    path: PathLike, inside: Optional[PathLike] = None, max_bytes: int = MAX_TEXT_BYTES, max_depth: int = MAX_JSON_DEPTH
):
    return parse_json(read_bytes(path, inside, max_bytes), str(path), max_depth)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exclusive_temp(path: Path) -> tuple:
    """(fd, temp path) of a new, empty file next to `path`, created exclusively (never an existing file or link)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"no free temporary name next to {path}")


def atomic_write_with(path: PathLike, write: Callable[[Path], None]) -> None:
    """Create an exclusive temporary file next to `path`, let `write(temp_path)` fill it (for libraries that write
    by path), fsync it, and rename it over `path`. On any failure the temporary file is removed."""
    path = Path(path)
    fd, tmp = _exclusive_temp(path)
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)  # replaces a link at `path` instead of following it
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write(path: PathLike, data: Union[str, bytes]) -> None:
    """Write `data` to `path` atomically: readers see the old file or the new one, never a part; links at `path`
    or at any temporary name are never followed."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = _exclusive_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def open_append(path: PathLike):
    """A text stream appending to `path` (created if missing), which must be a regular file, never a link."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(
                f"{path} is a symbolic link; dsaflow never writes through links in a run dir "
                "(refused). Fix: remove the link."
            ) from None
        raise UnsafeFile(f"{path} {explain_os_error(exc)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFile(f"{path} is {kind_of(st.st_mode)}, not a regular file (refused). Fix: remove it.")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def append_text(path: PathLike, text: str) -> None:
    with open_append(path) as f:
        f.write(text)
