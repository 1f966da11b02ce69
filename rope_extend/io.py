"""Writing files so that nothing is lost or left half-written: temporary names renamed when complete, and
output folders that are only ever emptied of what rope-extend itself wrote there."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import locking
from .errors import RopeExtendError
from .untrusted import check_folder, open_regular, read_object

# ------------------------------------------------------------------------------ temporaries and their owners
PROBE = ".rope-extend-probe-"  # the folder check_writable makes and removes at once: a killed one is harmless
OWNER = ".rope-extend-owner"  # inside each temporary folder: the host, pid and start time of the process using it
OWNER_BYTES = 4096  # an owner record is ~100 bytes


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (field 22 of ``/proc/PID/stat``), which tells
    a live process from a later one given the same pid; None where ``/proc`` is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def owned_tempdir(prefix: str, suffix: str, folder: Path) -> Path:
    """``tempfile.mkdtemp`` whose folder records its owner (``OWNER``), so that a later run can tell that the
    process that made it is gone (``remove_abandoned``)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=folder))
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}
    (tmp / OWNER).write_text(json.dumps(owner), encoding="utf-8")
    return tmp


def _abandoned(folder: Path) -> bool:
    """Whether ``folder`` is a temporary whose owner is provably gone: made on this host by a process that no
    longer runs (or whose pid now belongs to a process started at another time). Anything else, a folder of
    another host (a shared disk) or one without a readable owner record, is not proven abandoned."""
    try:  # not through a link, nor from a pipe planted there (it would block): the file owned_tempdir wrote
        owner = read_object(folder / OWNER, limit=OWNER_BYTES, follow_links=False)
        host, pid, started = owner["host"], int(owner["pid"]), owner.get("started")
    except (RopeExtendError, ValueError, KeyError, TypeError, OverflowError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    now = _started(pid)
    return started is not None and now is not None and now != started


def remove_abandoned(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries that interrupted writes of ``path`` left beside it (``.NAME.XXXX.tmp`` folders of
    ``atomic_path``, ``.NAME.download.XXXX`` folders of ``fetch``) when their owner is provably gone
    (``_abandoned``); returns what was removed. Nothing else is touched: not another process' temporary in
    use, not a folder without an owner record. Where a killed ``atomic_path`` left ``path`` itself missing in the
    middle of replacing a folder, the swap is finished first (``finish_swap``), so nothing the user had is lost."""
    path = Path(path)
    removed: list[Path] = []
    try:
        entries = list(path.parent.iterdir()) if path.parent.is_dir() else []
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(f".{path.name}.") and entry.is_dir() and not entry.is_symlink() and _abandoned(entry):
            finish_swap(entry)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _previous(tmp: Path, path: Path) -> Path:
    """Where ``atomic_path`` keeps the folder it replaces while it swaps: inside its own temporary (which names
    its owner), under a name the new folder (``tmp / path.name``) cannot have."""
    return tmp / f"{path.name}.previous"


def finish_swap(tmp: Path) -> None:
    """A process killed between ``atomic_path``'s two renames left the folder it replaced missing, the previous
    folder and the complete new one inside its temporary ``tmp`` (``.NAME.XXXX.tmp``; ``mkdtemp``'s XXXX has no
    dot): the swap is finished (the new one was complete before the first rename), or, where the new one is
    gone, the previous one is put back. Nothing happens while the folder exists. Call it before removing an
    abandoned temporary of ``atomic_path``."""
    if not tmp.name.endswith(".tmp") or not tmp.name.startswith(".") or tmp.is_symlink():
        return  # not atomic_path's temporary, or a link planted by that name: never followed
    path = tmp.parent / tmp.name[1:].rsplit(".", 2)[0]
    previous = _previous(tmp, path)
    if os.path.lexists(path) or not previous.is_dir() or previous.is_symlink():
        return
    new = tmp / path.name
    with contextlib.suppress(OSError):
        os.replace(new if new.is_dir() and not new.is_symlink() else previous, path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    Works for a file or a folder. On an exception the temporary is removed and ``path`` is untouched; when the
    process is killed, the temporary folder names its owner, and a later ``remove_abandoned(path)`` removes it
    (finishing the replacement of a folder that was killed half-way).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = owned_tempdir(f".{path.name}.", ".tmp", path.parent)
    target = tmp / path.name
    try:
        yield target
        if path.is_dir() and not path.is_symlink() and target.is_dir():
            # a folder cannot replace a folder in one rename: the old one moves into the temporary first, so a
            # process killed between the two renames leaves both where remove_abandoned finishes the swap
            os.replace(path, _previous(tmp, path))
            try:
                os.replace(target, path)
            except BaseException:  # the temporary is removed below: the previous folder goes back first
                os.replace(_previous(tmp, path), path)
                raise
        else:
            os.replace(target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_writable(path: str | os.PathLike, what: str = "--out", *, error=None) -> None:
    """The one check of every command's output path (a folder to fill, a file or folder to write), made before
    any model is loaded so that a failure is one line naming the path, not an OSError after the work.

    Refused: ``path`` itself a symbolic link (rope-extend never writes through a link, so it never writes into
    the folder or file a link leads to), a link to nothing on the way, a file where a parent folder would be
    (``afile/m.gguf``), and a folder that cannot be written: the existing ``path`` or, when it is to be made,
    its nearest existing parent. Permissions do not tell (root passes ``access`` on ``/proc``, where nothing
    can be made), so a hidden folder is made there and removed at once: the kernel's own answer.
    Raises ``error`` (default ``RopeExtendError``).
    """
    fail = error or RopeExtendError
    path = Path(path)
    if path.is_symlink():
        raise fail(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}): rope-extend never writes through a link; "
            "give the real path of a new or empty folder, or another path"
        )
    folder = path if path.is_dir() else path.absolute().parent
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if folder.is_symlink() and not folder.exists():
        raise fail(f"{what} {path}: {folder} is a link to nothing ({os.readlink(folder)}); give a path in a folder")
    if not folder.is_dir():
        raise fail(f"{what} {path}: {folder} is a file, not a folder; give a path in a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE, dir=folder))
    except OSError as exc:
        where = "the folder itself" if folder == path else f"the folder {folder}"
        reason = exc.strerror or type(exc).__name__
        raise fail(
            f"cannot write {what} {path}: {reason} ({where} cannot be written); give a path you can write"
        ) from None


@contextlib.contextmanager
def one_line(what: str, path: str | os.PathLike, error=None) -> Iterator[None]:
    """Turn an OS failure in the block (a folder that turns out not to be writable, a full disk) into ``error``
    (default ``RopeExtendError``) naming ``path`` and the reason, in one line."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise (error or RopeExtendError)(f"cannot write {what} {path}: {reason}; give a path you can write") from None


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str = "--out") -> Iterator[Path]:
    """``atomic_path`` whose OS failures end in one line naming ``path`` and the reason (``one_line``)."""
    with one_line(what, path), atomic_path(path) as tmp:
        yield tmp


def normal_permissions(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes a new file gets: 0666 for files and
    0777 for folders, less the umask. Copies of a cache keep its private 0600 modes otherwise, and a server
    running as another user cannot read them."""
    mask = os.umask(0)
    os.umask(mask)
    path = Path(path)
    items = [path, *path.rglob("*")] if path.is_dir() and not path.is_symlink() else [path]
    for item in items:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def _copy_open(fin, fout) -> None:
    """The rest of the open file ``fin`` into ``fout``: by ``os.sendfile``, in the kernel, where it can (as
    ``shutil.copyfile`` does: 0.33 s a GiB here, as copytree; through Python's buffers 2.5 to 2.9 s), else through
    a buffer, from where it stopped."""
    try:
        while os.sendfile(fout.fileno(), fin.fileno(), None, 1 << 30) > 0:
            pass
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSOCK):
            raise
    shutil.copyfileobj(fin, fout, 1 << 20)


def copy_folder(source: str | os.PathLike, dest: str | os.PathLike, *, ignore=None) -> None:
    """Copy a user's folder (a model folder: ``configure`` and the folder exports copy it whole) to the new folder
    ``dest``, as ``shutil.copytree`` with ``ignore``, links to files followed. Every entry is checked first
    (``untrusted.check_folder``): a named pipe, a device, a link to nothing or to a folder is one line naming it
    and what it is, before anything is copied, where copytree ended in "cannot write --out: Error" (a pipe) or
    never (``/dev/zero``). Each file is then read from what ``untrusted.open_regular`` opened (one swapped for a
    pipe since the check is refused there); an OS failure (a full disk) names the file and the reason."""
    source = Path(source)
    fix = f"a model folder that is copied may hold only files (or links to files) and folders: move it out of {source}"
    check_folder(source, ignore=ignore, fix=fix)

    def copy(src: str, dst: str) -> None:
        with open_regular(src, fix=fix) as fin, open(dst, "wb") as fout:
            _copy_open(fin, fout)
            st = os.fstat(fin.fileno())
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))  # as copytree's copy2 keeps them

    try:
        shutil.copytree(source, dest, ignore=ignore, copy_function=copy)
    except shutil.Error as exc:  # copytree gathers each file's OSError into one Error whose text is a list
        failed = exc.args[0] if exc.args and isinstance(exc.args[0], list) else []
        said = "{}: {}".format(*failed[0][::2]) if failed and len(failed[0]) == 3 else " ".join(str(exc).split())
        raise RopeExtendError(f"cannot copy the model folder {source}: {said[:300]}") from None


def sha256(path: str | os.PathLike, *, name: str | None = None, fix: str = "") -> str:
    """The file's SHA-256 hex digest, read in 1 MiB blocks; the one digest of a file rope-extend takes (a fetched
    file, a served GGUF: records keep its first 16 digits). The file is opened as ``untrusted`` opens a user's
    (links followed): only a regular file, so that a named pipe is refused at once rather than waited on for
    ever, and a device that never ends is never read; anything else is one ``RopeExtendError`` naming ``name``
    (the path by default) and ending with ``fix``."""
    digest = hashlib.sha256()
    with open_regular(path, name=name, fix=fix) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


# ------------------------------------------------------------------------------------------ output folders
MARKER = ".rope-extend"  # written into every folder rope-extend creates for its output
MARKER_BYTES = 1 << 20  # a marker is ~100 bytes (configure's lists the entries it wrote)


def _temporary(name: str) -> bool:
    """Leftovers of an interrupted atomic write (``atomic_path``): ``.name.XXXX.tmp`` or ``.name.old-PID``, or a
    probe of ``check_writable`` whose process was killed between making and removing it."""
    return name.startswith(".") and (name.endswith(".tmp") or ".old-" in name or name.startswith(PROBE))


def read_marker(folder: str | os.PathLike) -> dict[str, Any]:
    """What the marker of ``folder`` says (``{}`` when there is none): read only from a small regular file, not
    through a link, and only a JSON object; anything else is not a marker rope-extend wrote (``{}``)."""
    try:
        return read_object(Path(folder) / MARKER, limit=MARKER_BYTES, follow_links=False)
    except RopeExtendError:
        return {}


def unsafe_folder(path: Path) -> str | None:
    """Why ``path`` must never be an output folder (the working folder, one of its parents, the home
    folder, the filesystem root), or None."""
    target = path.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd:
        return "is the working folder"
    if target in cwd.parents:
        return "is a parent of the working folder"
    if target == Path.home().resolve():
        return "is the home folder"
    if target == Path(target.anchor):
        return "is the filesystem root"
    return None


def claim_output_dir(
    path: str | os.PathLike,
    *,
    kind: str,
    owned: Callable[[str], bool],
    resume: bool = False,
    overwrite: bool = False,
    what: str = "--out",
    check_only: bool = False,
    error=None,
    how: str = "pass --resume to continue it or --overwrite to replace it",
) -> Path:
    """Make ``path`` this command's output folder without losing anything a user made.

    - a new or empty folder is created and marked (``.rope-extend``, naming ``kind``);
    - a folder that rope-extend did not make (no marker, or files ``owned`` does not claim) is refused,
      whatever the flags: nothing in it is touched; so is one made by another command;
    - an earlier ``kind`` run: ``resume`` keeps it, ``overwrite`` removes only the entries it wrote;
      otherwise it is refused;
    - the working folder, its parents, the home folder and the root are refused; so are an existing file, a
      symbolic link, and a folder that cannot be written (``check_writable``, the check every command makes);
    - a folder another rope-extend process is writing is refused, naming it (``locking``), and so is a lock
      file that is not one (a link, a folder, a pipe: ``locking.check``); this process holds the folder's lock
      from here until it exits.

    With ``check_only`` nothing is created or removed (for ``--check`` and checks before a long setup: it
    refuses all that the claim would). Raises ``error`` (``RopeExtendError``) naming the folder, what is in the
    way, and what to do.
    """
    fail = error or RopeExtendError
    path = Path(path)
    if path.is_symlink():
        check_writable(path, what, error=fail)  # refuses it: a link is never followed, nor its folder listed
    why = unsafe_folder(path)
    if why:
        raise fail(f"{what} {path} {why}: give a new folder for this {kind} output")
    if path.exists() and not path.is_dir():
        raise fail(f"{what} {path} is a file, not a folder: give a folder for this {kind} output")
    locking.check(path, what=what, error=fail)  # a planted lock is no lock: the folder is not empty, nor ours
    with one_line(what, path, fail):
        entries = sorted(p.name for p in path.iterdir() if p.name != locking.LOCK) if path.is_dir() else []
    if entries:
        made = read_marker(path).get("kind")
        foreign = [n for n in entries if n != MARKER and not owned(n) and not _temporary(n)]
        if not isinstance(made, str) or (made == kind and foreign):
            listing = ", ".join((foreign or entries)[:5]) + (", ..." if len(foreign or entries) > 5 else "")
            raise fail(
                f"{what} {path} holds files rope-extend did not write ({listing}): nothing there is "
                "touched; give a new or empty folder"
            )
        if made != kind:
            raise fail(
                f"{what} {path} holds the output of a rope-extend {made} run, not a {kind} run: give another folder"
            )
    check_writable(path, what, error=fail)  # after the folder is known to be empty or ours: a probe goes there
    locking.lock(path, what=what, probe=check_only or not path.is_dir(), error=fail)  # before anything changes
    results = [n for n in entries if n != MARKER and not _temporary(n)]
    if results and not resume and not overwrite:
        raise fail(f"{what} {path} already holds results of an earlier {kind} run: {how}, or give another folder")
    if check_only or (entries and (resume or not results)):  # kept: continued, or nothing there to lose
        return path
    with one_line(what, path, fail):
        for name in entries:  # an earlier run's, replaced (--overwrite)
            if name != MARKER:
                target = path / name
                shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        path.mkdir(parents=True, exist_ok=True)
        locking.lock(path, what=what, error=fail)
        write_json(path / MARKER, {"kind": kind, "tool": "rope-extend"})
    return path
