"""Files the tools write and the checkpoints they read: one writer, atomic, never through a link.

Every file planner and its runtime write (plans, traces, metrics, PNGs, exports, calibrations,
HF directories, checkpoint files) goes through `write_bytes_atomic` / `write_text_atomic`, or
`write_new_file` for a file in a directory this run just created. The rules:

- **Atomic.** Data goes to a temporary sibling (``.NAME.XXXXXXXXXXXX.tmp``), is fsynced, and is
  renamed over the target, so a reader sees the old file or the whole new one; any failure
  (including an interrupt) removes the temporary file.
- **Regular files only.** An existing target that is a symbolic link, a directory, a FIFO, a
  device or a socket is refused with a `PlannerError`: a rename would replace the link or the
  device node itself (as root, ``-o /dev/null`` once replaced the system's), and opening a FIFO
  would block. The check runs before long work (`check_output`) and again just before the rename.
- **The process umask.** Temporary files are created with mode 0666, which the kernel masks with
  the umask, as ``open()`` would (`tempfile.mkstemp` gives 0600).
- **No links on the way in either.** `open_regular` opens a file for reading without following a
  symbolic link in its last component and refuses anything but a regular file; a checkpoint is
  hashed and parsed from that one open file, so what was verified is what is read.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from plans.errors import PlannerError, brief

NAME_MAX = 255  # bytes per path component on Linux, macOS and Windows file systems
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def non_regular_kind(mode: int) -> str | None:
    """What a file of `mode` (from `os.lstat`) is, when it is not a regular file; None for one."""
    return next((name for test, name in _KINDS if test(mode)), None)


def _os_problem(path: str | Path, e: OSError, *, verb: str) -> PlannerError:
    where = brief(str(path))
    if e.errno == errno.ENAMETOOLONG:
        longest = max((len(os.fsencode(p)) for p in Path(path).parts), default=0)
        return PlannerError(f"cannot {verb} {where}: the file name is too long ({longest} bytes in one component; "
                            f"file systems allow {NAME_MAX})", hint="choose a shorter name")
    return PlannerError(f"cannot {verb} {where}: {e.strerror or e}")


def _lstat(path: Path, *, verb: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise PlannerError(f"cannot {verb} {brief(str(path))}: a parent of it is a file, not a directory") from None
    except ValueError as e:  # a NUL byte in the path
        raise PlannerError(f"cannot {verb} {brief(str(path))}: {e}") from None
    except OSError as e:
        raise _os_problem(path, e, verb=verb) from None


def check_output(path: str | Path) -> Path:
    """`path` as a `Path` if the writer may create or replace it; a `PlannerError` now (before
    long work) if not: it exists and is not a regular file, its name is too long, or its nearest
    existing ancestor is a file or not writable."""
    path = Path(path)
    st = _lstat(path, verb="write")
    if st is not None:
        kind = non_regular_kind(st.st_mode)
        if kind == "a directory":
            raise PlannerError(f"cannot write {brief(str(path))}: it is a directory",
                               hint="give a file name, e.g. DIR/plan.json")
        if kind is not None:
            raise PlannerError(f"cannot write {brief(str(path))}: it is {kind}, not a regular file; planner never "
                               "replaces one", hint="give the path of a regular file (or of a new one)")
    name_bytes = len(os.fsencode(path.name))
    if name_bytes > NAME_MAX:
        raise PlannerError(f"cannot write {brief(str(path))}: the file name is too long ({name_bytes} bytes; file "
                           f"systems allow {NAME_MAX})", hint="choose a shorter name")
    parent = path.absolute().parent
    while _lstat(parent, verb="write") is None and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PlannerError(f"cannot write {brief(str(path))}: {brief(str(parent))} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise PlannerError(f"cannot write {brief(str(path))}: directory {brief(str(parent))} is not writable")
    return path


def _temporary(path: Path) -> Path:
    # The target's name is cut so the temporary name stays within NAME_MAX.
    return path.with_name(f".{path.name[:200]}.{secrets.token_hex(6)}.tmp")


def _write_fd(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename into it survives a crash once this returns)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; the rename is still atomic
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so readers see the old file or the whole new one, never a part
    (the rules in the module docstring); any problem is a `PlannerError` naming the path."""
    path = check_output(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _os_problem(path.parent, e, verb="create directory") from None
    tmp = _temporary(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise _os_problem(path, e, verb="write") from None
    try:
        try:
            _write_fd(fd, data)
        finally:
            os.close(fd)
        check_output(path)  # again: the target may have been swapped for a link meanwhile
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _os_problem(path, e, verb="write") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """`write_bytes_atomic` of `text` in UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_new_file(path: str | Path, data: bytes | memoryview, *, device: str | None = None) -> None:
    """Create `path`, which must not exist (a file of a directory this run just made), write and
    fsync `data`; a partial file is removed on failure. `device`, for fault-injection tests, is a
    file whose descriptor the data is written to instead (``/dev/full``: a real ENOSPC). Raises
    `OSError` for the caller to report (several ranks report theirs together)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        if device is not None:
            full = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
            os.dup2(full, fd)
            os.close(full)
        _write_fd(fd, data)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file reached without following a
    symbolic link in its last component (O_NOFOLLOW); `OSError` otherwise (ELOOP for a link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{non_regular_kind(os.fstat(fd).st_mode) or 'not a regular file'}, "
                          "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_directory(tmp: Path, final: Path) -> None:
    """Move the finished directory `tmp` to `final` (its sibling): an existing `final` is replaced
    (renamed aside, then deleted, so no reader sees a mix), a symbolic link is refused, and the
    parent is fsynced. Raises `OSError` for the caller to report, `PlannerError` for a link."""
    import shutil

    fsync_dir(tmp)
    if final.is_symlink():
        raise PlannerError(f"{brief(str(final))} is a symbolic link; planner never replaces one", hint="remove the link")
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    fsync_dir(final.parent)
