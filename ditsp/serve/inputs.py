"""A job's input from submission to its end: the server's own file under ``uploads/``, never a name elsewhere.

An upload is written there as ``<job id><ext>``. A file named by ``path`` is
opened once, at submission, component by component from its allowed folder
with ``O_NOFOLLOW`` (a link swapped in after the check makes the open fail),
and pinned: hard-linked from the file that was opened (the new link is checked
to be the same inode), or copied from the open descriptor when a link cannot be
made (another filesystem). A folder of frames is pinned frame by frame into
``uploads/<job id>/``. The job then reads its pinned copy only: replacing the
named file by a link to a file outside ``--allow-input`` after submission
changes nothing the job reads. The pinned copy is deleted when the job ends,
like an upload; the file that was named is never touched.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path

from fastapi import HTTPException, UploadFile

from ..io.formats import IMAGE_EXTS, VIDEO_EXTS

MiB = 2**20
INPUT_EXTS = tuple(IMAGE_EXTS) + tuple(VIDEO_EXTS)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def bad(status: int, msg: str) -> HTTPException:
    return HTTPException(status_code=status, detail=msg)


def disk_full() -> HTTPException:
    return bad(507, "the server's data disk is full; try again later")


@contextmanager
def _writing(dest: Path):
    """Writing ``dest``: on any failure it is removed (nothing half-written stays); a full disk is a 507."""
    try:
        yield
    except BaseException as e:
        release(str(dest))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            raise disk_full() from None
        raise


def release(path: str) -> None:
    """Delete a job's own input (a file, or a pinned folder of frames); a missing one is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except OSError:
        pass


class Inputs:
    """Uploads and pinned named inputs under ``uploads`` (a folder of the data dir)."""

    def __init__(self, uploads: Path, allowed: list[str], max_bytes: int):
        self.uploads = uploads
        self.allowed = allowed  # real paths of the --allow-input folders
        self.max_bytes = max_bytes

    # -- uploads ----------------------------------------------------------------------------------------

    def save_upload(self, file: UploadFile, job_id: str) -> str:
        """The upload written to ``uploads/<job id><ext>`` (the client's name is kept for display only)."""
        ext = Path(file.filename or "").suffix.lower()
        if ext not in INPUT_EXTS:
            raise bad(415, f"file: unsupported type {ext or '(no extension)'}; send one of {', '.join(INPUT_EXTS)}")
        dest = self.uploads / f"{job_id}{ext}"
        total = 0
        with _writing(dest), open(dest, "xb") as out:
            while chunk := file.file.read(MiB):
                total += len(chunk)
                if total > self.max_bytes:
                    raise bad(413, f"upload larger than {self.max_bytes / MiB:g} MiB")
                out.write(chunk)
        if total == 0:
            release(str(dest))
            raise bad(400, "file: empty upload")
        return str(dest)

    # -- named inputs -----------------------------------------------------------------------------------

    def pin_named(self, path: str, job_id: str) -> tuple[str, str]:
        """``(pinned path, display name)`` of a file or folder of frames named under an allowed folder."""
        if not self.allowed:
            raise bad(403, "this server reads no input folders (start it with --allow-input DIR)")
        if "\x00" in path:
            raise bad(400, "path: bad characters")
        real = self._resolve(path)
        fd = self._open(real)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                ext = Path(real).suffix.lower()
                if ext not in INPUT_EXTS:
                    raise bad(415, f"path: unsupported type {ext or '(no extension)'}; "
                                   f"name one of {', '.join(INPUT_EXTS)} or a folder of frames")
                dest = self.uploads / f"{job_id}{ext}"
                self._pin_file(fd, real, dest)
            elif stat.S_ISDIR(st.st_mode):
                dest = self.uploads / job_id
                self._pin_folder(fd, real, dest)
            else:
                raise _not_regular("path")
        finally:
            os.close(fd)
        return str(dest), os.path.basename(real)[:200]

    def _resolve(self, path: str) -> str:
        """The real path named (``..`` and links resolved), inside an allowed folder; 403/404 otherwise."""
        candidates = [path] if os.path.isabs(path) else [os.path.join(d, path) for d in self.allowed]
        for c in candidates:
            real = os.path.realpath(c)
            if self._root_of(real) is None:  # '..', an absolute path elsewhere, or a link leading out
                raise bad(403, "path: outside the allowed input folders")
            if os.path.lexists(real):
                return real
        raise bad(404, "path: no such file under the allowed input folders")

    def _root_of(self, real: str) -> str | None:
        inside = [d for d in self.allowed if _within(real, d)]
        return max(inside, key=len) if inside else None

    def _open(self, real: str) -> int:
        """A descriptor of ``real``, opened from its allowed folder one component at a time, following no link.

        A pipe, socket or device is refused before it is opened (opening one
        could block or read without end), and again from the descriptor.
        """
        root = self._root_of(real)
        if root is None:
            raise bad(403, "path: outside the allowed input folders")
        try:
            mode = os.stat(real).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise _not_regular("path")
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            parts = [p for p in os.path.relpath(real, root).split(os.sep) if p not in ("", ".")]
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
                try:
                    nxt = os.open(part, flags, dir_fd=fd)
                finally:
                    os.close(fd)
                fd = nxt
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):  # a link or a file was swapped in
                raise bad(403, "path: changed while it was being opened (a link appeared); not read") from None
            if e.errno == errno.ENOENT:
                raise bad(404, "path: no such file under the allowed input folders") from None
            if e.errno == errno.EACCES:
                raise bad(403, "path: permission denied") from None
            raise bad(400, f"path: cannot be opened ({e.strerror})") from None
        return fd

    def _pin_file(self, fd: int, real: str, dest: Path) -> None:
        """``dest`` made the file open as ``fd``: a hard link when it is provably that file, else a copy."""
        try:
            parent = os.open(os.path.dirname(real), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            parent = None
        try:
            with _writing(dest):
                if parent is not None:
                    try:
                        os.link(os.path.basename(real), dest, src_dir_fd=parent, follow_symlinks=False)
                        have, held = os.lstat(dest), os.fstat(fd)
                        if (have.st_dev, have.st_ino) == (held.st_dev, held.st_ino):
                            return
                        os.remove(dest)  # the name was swapped after the open: copy what was opened
                    except OSError as e:
                        if e.errno in DISK_FULL:
                            raise
                with open(fd, "rb", closefd=False) as src, open(dest, "xb") as out:  # another filesystem
                    src.seek(0)
                    shutil.copyfileobj(src, out, MiB)
        finally:
            if parent is not None:
                os.close(parent)

    def _pin_folder(self, fd: int, real: str, dest: Path) -> None:
        """The frames of the folder open as ``fd`` pinned one by one into ``dest`` (hidden files and other
        types are left out, as the frame reader leaves them out)."""
        os.mkdir(dest, 0o700)
        with _writing(dest):
            with os.scandir(fd) as it:
                names = sorted(e.name for e in it
                               if not e.name.startswith(".") and Path(e.name).suffix.lower() in IMAGE_EXTS)
            for name in names:
                inner = os.path.realpath(os.path.join(real, name))
                if self._root_of(inner) is None:
                    raise bad(403, f"path: {name} in the folder leads outside the allowed input folders")
                try:
                    frame = self._open(inner)
                except HTTPException as e:
                    raise bad(e.status_code, e.detail.replace("path:", f"path: {name} in the folder:", 1)) from None
                try:
                    if not stat.S_ISREG(os.fstat(frame).st_mode):
                        raise _not_regular(f"path: {name} in the folder")
                    self._pin_file(frame, inner, dest / name)
                finally:
                    os.close(frame)


def _within(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:
        return False


def _not_regular(what: str) -> HTTPException:
    return bad(400, f"{what}: not a regular file or a folder (pipes, sockets and devices are refused)")
