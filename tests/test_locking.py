"""One writer per output folder: a second process is refused, naming the first; a dead one's lock is taken."""

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
