"""One writer per output folder: a second process is refused, naming the first; a dead one's lock is taken."""

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rope_extend import locking
from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.report import owned
from rope_extend.io import claim_output_dir

HOLDER = textwrap.dedent(
    """
    import sys, time
    from rope_extend.io import claim_output_dir
    from rope_extend.evaluation.report import owned
    claim_output_dir(sys.argv[1], kind="eval", owned=owned)
    print("holding", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another process that has claimed ``tmp_path / 'out'`` and holds it until killed."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "holding"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_writer_is_refused_naming_the_first_until_it_dies(tmp_path, holder):
    out = tmp_path / "out"
    for check_only in (True, False):
        with pytest.raises(RopeExtendError, match=rf"--out {out} is being written by another rope-extend process") as e:
            claim_output_dir(out, kind="eval", owned=owned, resume=True, check_only=check_only)
        assert f"pid {holder.pid} on " in str(e.value) and "started 20" in str(e.value)
    assert not (out / "records.jsonl").exists()
    os.kill(holder.pid, signal.SIGKILL)  # its lock file stays, naming a dead process: taken over
    holder.wait()
    assert json.loads((out / locking.LOCK).read_text())["pid"] == holder.pid
    claim_output_dir(out, kind="eval", owned=owned, resume=True)
    assert json.loads((out / locking.LOCK).read_text())["pid"] == os.getpid()
    claim_output_dir(out, kind="eval", owned=owned, resume=True)  # this process again: its own lock
    locking.release(out)
    assert (out / locking.LOCK).read_text() == ""


def test_the_command_line_refuses_a_busy_folder_in_one_line(tmp_path, holder, capsys):
    out = tmp_path / "out"
    code = main(["eval", "passkey", "--model", "nowhere", "--lengths", "128", "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"(pid {holder.pid} on " in err


def test_the_lock_file_is_not_a_foreign_file_and_survives_overwrite(tmp_path):
    out = tmp_path / "out"
    claim_output_dir(out, kind="eval", owned=owned)
    (out / "records.jsonl").write_text("")
    locking.release(out)  # as after the process ended
    claim_output_dir(out, kind="eval", owned=owned, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [".rope-extend", locking.LOCK]
    locking.release(out)


# ------------------------------------------------------------------ a lock file that is not one is never written
USER_FILE = b"a user's file: every byte of it must survive\n"


def _plant(out, kind, outside):
    """Put ``kind`` where the lock of folder ``out`` goes; ``outside`` is a user's file beside the folder."""
    out.mkdir()
    lock = out / locking.LOCK
    if kind == "link to a file":
        lock.symlink_to(outside)
    elif kind == "dangling link":
        lock.symlink_to(outside.with_name("created-by-the-lock"))
    elif kind == "hard link":
        os.link(outside, lock)
    elif kind == "folder":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        assert kind == "user's file by that name"
        lock.write_bytes(USER_FILE)


PLANTED = {
    "link to a file": "a symbolic link",
    "dangling link": "a symbolic link",
    "hard link": "a file with 2 hard links (another name of some other file)",
    "folder": "a folder",
    "fifo": "a named pipe",
    "user's file by that name": "a file that is not a holder record",
}


CLAIMS = textwrap.dedent(
    """
    import sys
    from rope_extend.errors import RopeExtendError
    from rope_extend.evaluation.report import owned
    from rope_extend.io import claim_output_dir
    for out in sys.argv[1:]:
        for check_only in (True, False):
            try:
                claim_output_dir(out, kind="eval", owned=owned, check_only=check_only)
            except RopeExtendError as exc:
                print(exc, flush=True)
    """
)


def test_a_planted_lock_is_refused_and_nothing_is_written_through_it(tmp_path, capsys):
    outside = tmp_path / "user.txt"
    outside.write_bytes(USER_FILE)
    outs = {kind: tmp_path / f"out{i}" for i, kind in enumerate(PLANTED)}
    for kind, out in outs.items():
        _plant(out, kind, outside)
    before = {kind: sorted(os.listdir(out)) for kind, out in outs.items()}
    # another process claims each folder and ends (its exit clears the locks it held): a line per refusal
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", CLAIMS, *map(str, outs.values())],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 * len(outs)
    for (kind, out), refusals in zip(outs.items(), zip(lines[::2], lines[1::2], strict=True), strict=True):
        for line in refusals:
            assert line.startswith(f"--out {out}: its lock {out / locking.LOCK} is {PLANTED[kind]}, not the lock")
    # the command line, in this process: one line, exit 2, whatever the flags
    for (kind, out), flags in itertools.product(outs.items(), ([], ["--resume"], ["--overwrite"])):
        capsys.readouterr()
        assert main(["eval", "passkey", "--model", "nowhere", "--lengths", "128", "--out", str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is {PLANTED[kind]}, not the lock file" in err, err
    locking._release_all()  # what the end of this process does
    assert outside.read_bytes() == USER_FILE
    for kind, out in outs.items():  # no marker: a folder holding a planted lock is not empty, nor ours
        assert sorted(os.listdir(out)) == before[kind]
    assert sorted(os.listdir(tmp_path)) == sorted([*(o.name for o in outs.values()), "user.txt"])  # nothing outside
    assert (outs["user's file by that name"] / locking.LOCK).read_bytes() == USER_FILE


def test_a_lock_swapped_for_a_link_while_held_is_not_taken_again(tmp_path):
    out = tmp_path / "out"
    claim_output_dir(out, kind="eval", owned=owned)
    moved = tmp_path / "moved.lock"
    os.replace(out / locking.LOCK, moved)
    (out / locking.LOCK).symlink_to(moved)  # the same file, through a link: not the lock any more
    with pytest.raises(RopeExtendError, match="is a symbolic link"):
        claim_output_dir(out, kind="eval", owned=owned, resume=True)
    assert json.loads(moved.read_text())["pid"] == os.getpid()  # given back only by its descriptor: kept as is


# ---------------------------------------------------------------------- export: one writer per path, too
EXPORT_HOLDER = textwrap.dedent(
    """
    import sys, time
    from rope_extend import locking
    with locking.beside(sys.argv[1]):
        print("holding", flush=True)
        time.sleep(120)
    """
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.tiny import tiny_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("to,name", [("vllm", "served"), ("gguf", "m.gguf")])
def test_a_second_export_to_one_path_is_refused_naming_the_first(tmp_path, tiny_folder, capsys, to, name):
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", EXPORT_HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    argv = ["export", str(tiny_folder), "--to", to, "--method", "yarn", "--factor", "2", "--out", str(out)]
    argv += ["--tokenizer-pre", "smollm"] if to == "gguf" else []
    try:
        assert proc.stdout.readline().strip() == "holding"
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out} is being written by another rope-extend process" in err, err
        assert f"(pid {proc.pid} on " in err
        assert sorted(os.listdir(tmp_path)) == [f".{name}{locking.LOCK}"]  # the holder's lock, and nothing else
    finally:
        proc.kill()
        proc.wait()
    assert main(argv) == 0  # its holder gone: the export runs, and its lock goes with it
    assert sorted(os.listdir(tmp_path)) == [name]
    if out.is_dir():
        assert not any(p.name.endswith(locking.LOCK) for p in out.rglob("*"))  # never inside the artifact
    assert main(argv) == 2 and "exists" in capsys.readouterr().err  # the second, after the first: refused too


def test_a_planted_lock_beside_an_export_is_refused(tmp_path, tiny_folder, capsys):
    outside = tmp_path / "user.txt"
    outside.write_bytes(USER_FILE)
    (tmp_path / f".m.gguf{locking.LOCK}").symlink_to(outside)
    argv = [
        "export",
        str(tiny_folder),
        "--to",
        "gguf",
        "--method",
        "yarn",
        "--factor",
        "2",
        "--tokenizer-pre",
        "smollm",
    ]
    assert main([*argv, "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"its lock {tmp_path}/.m.gguf{locking.LOCK} is a symbolic link" in err, err
    assert outside.read_bytes() == USER_FILE and not (tmp_path / "m.gguf").exists()


HOSTILE = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, sys.argv[2].encode())
    print("holding", flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize(
    ("record", "said"),
    [
        ("[" * 4000, "a process that has not written its name yet"),  # past json's recursion: no RecursionError
        ('{"pid": 1, "host": "h\\nx", "started": "s", "command": "a\\nb"}', "pid 1 on h x, started s: a b"),
        ('{"pid": [1, 2]}', "a process that has not written its name yet"),
    ],
    ids=["deep", "newlines", "fields missing"],
)
def test_a_holder_record_of_any_content_is_said_in_one_line(tmp_path, capsys, record, said):
    """The holder record is read from a file another process holds: whatever it wrote there (JSON nested past
    Python's recursion limit, newlines inside the text, missing fields), the refusal is one line."""
    out = tmp_path / "out"
    claim_output_dir(out, kind="eval", owned=owned)
    locking.release(out)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOSTILE, str(out / locking.LOCK), record], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "holding"
        code = main(["eval", "passkey", "--model", "nowhere", "--lengths", "128", "--out", str(out), "--resume"])
    finally:
        proc.kill()
        proc.wait()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"is being written by another rope-extend process ({said})" in err
