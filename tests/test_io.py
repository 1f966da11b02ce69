"""Output folders: claim_output_dir never loses what a user made, and a run that wrote nothing blocks nothing."""

import hashlib
import os

import pytest

from rope_extend.errors import RopeExtendError
from rope_extend.io import MARKER, claim_output_dir, sha256
from rope_extend.locking import LOCK
from tests.blocking import within


def owned(name):
    return name in {"records.jsonl", "report.md"}


def test_new_folder_is_marked(tmp_path):
    out = claim_output_dir(tmp_path / "run", kind="eval", owned=owned)
    assert (out / MARKER).is_file()


def test_a_run_that_wrote_nothing_can_be_run_again(tmp_path):
    out = claim_output_dir(tmp_path / "run", kind="eval", owned=owned)  # then the run fails on a bad input
    assert claim_output_dir(out, kind="eval", owned=owned) == out  # no --resume, no --overwrite needed


def test_results_are_kept_unless_told(tmp_path):
    out = claim_output_dir(tmp_path / "run", kind="eval", owned=owned)
    (out / "records.jsonl").write_text("{}\n")
    with pytest.raises(RopeExtendError, match="already holds results"):
        claim_output_dir(out, kind="eval", owned=owned)
    assert (out / "records.jsonl").read_text() == "{}\n"
    assert claim_output_dir(out, kind="eval", owned=owned, resume=True) == out
    claim_output_dir(out, kind="eval", owned=owned, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, LOCK]  # the marker and this process's lock


def test_foreign_files_and_other_kinds_are_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(RopeExtendError, match="did not write"):
        claim_output_dir(mine, kind="eval", owned=owned, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep"
    other = claim_output_dir(tmp_path / "other", kind="train", owned=owned)
    with pytest.raises(RopeExtendError, match="not a eval run"):
        claim_output_dir(other, kind="eval", owned=owned, overwrite=True)


def test_a_marker_is_read_only_from_a_small_regular_file_of_its_own(tmp_path):
    from rope_extend.io import read_marker

    secret = tmp_path / "secret.json"
    secret.write_text('{"kind": "eval"}')
    cases = {
        "link": lambda m: m.symlink_to(secret),  # a marker is never read through a link
        "list": lambda m: m.write_text('["kind", "eval"]'),
        "not json": lambda m: m.write_text("kind: eval"),
        "folder": lambda m: m.mkdir(),
        "too big": lambda m: m.write_text('{"kind": "eval", "pad": "' + "x" * (1 << 20) + '"}'),
    }
    for name, plant in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        plant(folder / MARKER)
        (folder / "records.jsonl").write_text("{}\n")
        assert read_marker(folder) == {}, name
        with pytest.raises(RopeExtendError, match=r"did not write \(\.rope-extend, records\.jsonl\)"):
            claim_output_dir(folder, kind="eval", owned=owned, resume=True)
    assert read_marker(tmp_path / "nowhere") == {}


def test_check_writable_refuses_in_one_line_and_leaves_nothing(tmp_path):
    from rope_extend.io import check_writable

    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(RopeExtendError, match=r"afile is a file, not a folder"):
        check_writable(tmp_path / "afile" / "m.gguf")
    with pytest.raises(RopeExtendError, match=r"dangling is a link to nothing"):
        check_writable(tmp_path / "dangling" / "sub" / "m.gguf")
    with pytest.raises(RopeExtendError, match=rf"--out {tmp_path}/link is a symbolic link \(to {tmp_path}\)"):
        check_writable(tmp_path / "link")
    with pytest.raises(
        RopeExtendError, match=r"cannot write output_dir /proc/x/y: .* \(the folder /proc cannot be written\)"
    ):
        check_writable("/proc/x/y", "output_dir")
    check_writable(tmp_path / "new" / "deeper")  # a folder to be made, in one that can be written
    check_writable(tmp_path / "link" / "new")  # a link on the way is the user's own path: followed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dangling", "link"]  # the probes are gone


def test_a_killed_probe_is_not_a_foreign_file(tmp_path):
    out = claim_output_dir(tmp_path / "run", kind="eval", owned=owned)
    (out / ".rope-extend-probe-abc123").mkdir()  # a process killed between making and removing its probe
    assert claim_output_dir(out, kind="eval", owned=owned) == out


def test_a_planted_marker_or_owner_record_is_never_waited_on_nor_read_through_a_link(tmp_path):
    """The marker and a temporary's owner record are files rope-extend wrote: a named pipe by their name would
    block a plain read for good, and a link would lend another file's content (here, one naming a dead owner,
    which would have a live temporary removed). Both are read through ``untrusted``: refused at once."""
    import json
    import os
    import subprocess
    import sys
    import time

    from rope_extend.io import OWNER, owned_tempdir, read_marker, remove_abandoned

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    target = tmp_path / "out" / "m"
    target.parent.mkdir()
    dead = owned_tempdir(".m.", ".tmp", target.parent)  # control: a real owner record of a dead process
    record = json.loads((dead / OWNER).read_text())
    (dead / OWNER).write_text(json.dumps({**record, "pid": gone.pid, "started": "0"}))
    lent = tmp_path / "lent.json"
    lent.write_text((dead / OWNER).read_text())
    piped, linked = owned_tempdir(".m.", ".tmp", target.parent), owned_tempdir(".m.", ".tmp", target.parent)
    (piped / OWNER).unlink()
    os.mkfifo(piped / OWNER)
    (linked / OWNER).unlink()
    (linked / OWNER).symlink_to(lent)
    start = time.monotonic()
    assert remove_abandoned(target) == [dead]
    assert piped.is_dir() and linked.is_dir() and lent.read_text()  # not proven abandoned: kept
    folder = tmp_path / "fifo-marker"
    folder.mkdir()
    os.mkfifo(folder / MARKER)
    assert read_marker(folder) == {}
    assert time.monotonic() - start < 5


def test_the_one_digest_reads_only_a_regular_file(tmp_path):
    """``io.sha256`` is every digest of a file rope-extend takes (fetched files, a served GGUF's record): the
    SHA-256 of the bytes, and a named pipe refused at once (a plain ``open`` waited for a writer for ever)."""
    data = os.urandom(3 << 20 | 123)  # more than one 1 MiB block, and a part of one
    (tmp_path / "f.bin").write_bytes(data)
    assert sha256(tmp_path / "f.bin") == hashlib.sha256(data).hexdigest()
    (tmp_path / "link.bin").symlink_to(tmp_path / "f.bin")  # a user's file may be a link (the hub's cache)
    assert sha256(tmp_path / "link.bin") == hashlib.sha256(data).hexdigest()
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    with pytest.raises(RopeExtendError) as err:
        within(10, lambda: sha256(fifo, fix="give a file"), fifo)
    assert str(err.value) == f"{fifo} is a named pipe, not a regular file: give a file"


_KILLED_MID_SWAP = """
import os, sys
from pathlib import Path
from rope_extend import io

real, calls = os.replace, []
def replace(src, dst):
    calls.append(dst)
    if len(calls) == 2:  # between moving the old folder away and moving the new one in
        os._exit(9)
    real(src, dst)
io.os.replace = replace
with io.atomic_path(Path(sys.argv[1])) as tmp:
    tmp.mkdir()
    (tmp / "weights").write_text("new")
"""


def test_a_folder_replacement_killed_between_its_renames_is_finished_later(tmp_path):
    """Before, the old folder sat at ``.NAME.old-PID`` with nothing to put it back, and the path was gone."""
    import subprocess
    import sys

    from rope_extend.io import atomic_path, remove_abandoned

    out = tmp_path / "model"
    out.mkdir()
    (out / "weights").write_text("old")
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_SWAP, str(out)], check=False, cwd=os.getcwd())
    assert proc.returncode == 9
    assert not out.exists()  # killed half-way: the folder is nowhere a user would look
    remove_abandoned(out)
    assert (out / "weights").read_text() == "new"  # the new folder was complete before the first rename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # and nothing else is left
    with atomic_path(out) as tmp:  # an ordinary replacement afterwards leaves nothing beside it either
        tmp.mkdir()
        (tmp / "weights").write_text("newer")
    assert (out / "weights").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_second_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    from rope_extend import io

    out = tmp_path / "model"
    out.mkdir()
    (out / "weights").write_text("old")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    with pytest.raises(OSError, match="No space"), io.atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "weights").write_text("new")
    assert (out / "weights").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
