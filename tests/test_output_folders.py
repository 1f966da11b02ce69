"""Every command's output path goes through one check (``io.check_writable``, called by ``claim_output_dir``
and by export) before any model is loaded: a read-only or immutable folder, a planted lock that is a folder, a
``--out`` that is a symbolic link (to a user's folder, or to nothing), ``/proc`` end in one line, exit 2, and
every file that was there before unchanged. Also: configure removes what a killed configure left, ``card
--overwrite`` replaces an earlier card, and ``card`` into an eval folder says so."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rope_extend import locking
from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.io import MARKER, OWNER, check_writable
from tests.tiny import tiny_model, tiny_tokenizer

# command: (arguments before --out, whether --out is replaced in one rename: its lock is then beside it)
COMMANDS = {
    "eval": (["eval", "passkey", "--model", "nowhere", "--lengths", "128"], False),
    "compare": (["eval", "compare", "smoke", "--model", "nowhere"], False),
    "card": (["card", "nowhere"], False),
    "search": (["search", "--model", "nowhere", "--factor", "2", "--data", "{texts}"], False),
    "demo": (["demo", "--quick"], False),
    "train": (["train", "tiny-cpu"], False),
    "configure": (["configure", "{tiny}", "--method", "yarn", "--factor", "2"], True),
    "export": (["export", "{tiny}", "--to", "vllm"], True),
}


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` as it is, links not followed: a file's bytes, a link's target, a folder."""
    seen: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                seen[str(p)] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                seen[str(p)] = p.read_bytes()
            else:
                seen[str(p)] = stat.S_IFMT(st.st_mode)
    return seen


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def no_model_loads(monkeypatch):
    """A command that got past the check of its folder would load a model: make that an error of its own."""

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the output folder was checked")

    import importlib

    names = ("loading", "bundled", "evaluation.card", "evaluation.compare", "training.model")
    modules = [importlib.import_module(f"rope_extend.{name}") for name in names]  # all bind the real one first
    for module in modules:
        monkeypatch.setattr(module, "load_model", loaded)
    monkeypatch.setattr(importlib.import_module("rope_extend.bundled"), "load", loaded)


def _immutable(folder: Path) -> None:
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False).returncode != 0:
        pytest.skip("chattr +i is not allowed here (no CAP_LINUX_IMMUTABLE, or the filesystem has no such flag)")


def _plant(case: str, root: Path, beside: bool) -> tuple[Path, str]:
    """Make the bad ``--out`` of ``case`` under ``root``; returns it and the pattern of the expected message."""
    out = root / "out"
    if case == "immutable":
        _immutable(out)
        return (
            root / "out" / "new" if beside else out
        ), r": Operation not permitted \(the folder .*cannot be written\)"
    if case == "lock that is a folder":
        if beside:
            (root / f".out{locking.LOCK}").mkdir()
            return out, rf"its lock {root}/\.out\.rope-extend\.lock is a folder, not the lock file"
        (out / locking.LOCK).mkdir(parents=True)
        return out, r"its lock .*/out/\.rope-extend\.lock is a folder, not the lock file"
    if case == "symlink to a user's folder":
        (root / "mine").mkdir()  # empty: the case where writing through the link would have looked fine
        out.symlink_to(root / "mine")
        return out, rf"{out} is a symbolic link \(to {root}/mine\): rope-extend never writes through a link"
    if case == "dangling symlink":
        out.symlink_to(root / "nowhere")
        return out, rf"{out} is a symbolic link \(to {root}/nowhere\)"
    assert case == "/proc"
    return Path("/proc/rope-extend-test/out"), r"\(the folder /proc cannot be written\)"


CASES = ["immutable", "lock that is a folder", "symlink to a user's folder", "dangling symlink", "/proc"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.usefixtures("no_model_loads")
def test_every_command_refuses_a_bad_output_folder_before_loading(command, case, tiny, tmp_path, monkeypatch, capsys):
    import re

    root = tmp_path / "root"
    root.mkdir()
    (root / "texts.txt").write_text("some text to search on. " * 200)
    args, beside = COMMANDS[command]
    out, pattern = _plant(case, root, beside)
    before = _snapshot(root)
    flag = [f"output_dir={out}"] if command == "train" else ["--out", str(out)]
    argv = [a.format(tiny=tiny, texts=root / "texts.txt") for a in args] + flag
    monkeypatch.chdir(tmp_path)
    try:
        capsys.readouterr()
        code = main(argv)
    finally:
        subprocess.run(["chattr", "-i", str(root / "out")], capture_output=True, check=False)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    what = "output_dir" if command == "train" else "--out"
    assert re.match(rf"rope-extend: error: (cannot write )?{what} {re.escape(str(out))}\b", err), err
    assert re.search(pattern, err), err
    assert _snapshot(root) == before
    assert not (root / "nowhere").exists() and not Path("/proc/rope-extend-test").exists()


def test_a_read_only_folder_is_refused_unless_the_user_can_write_it(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.geteuid() == 0:  # root writes into a 0555 folder: the right result is to accept it
            check_writable(ro)
            check_writable(ro / "new")
        else:
            with pytest.raises(RopeExtendError, match=rf"--out {ro}: Permission denied \(the folder itself cannot"):
                check_writable(ro)
            with pytest.raises(RopeExtendError, match=rf"new: Permission denied \(the folder {ro} cannot be written"):
                check_writable(ro / "new")
        assert list(ro.iterdir()) == []  # the probe is gone
    finally:
        ro.chmod(0o755)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _temporary(parent: Path, name: str, pid: int) -> Path:
    """A temporary of an interrupted ``configure`` into ``parent/out`` (``io.atomic_path``): a copy in progress."""
    tmp = parent / name
    (tmp / "out").mkdir(parents=True)
    (tmp / "out" / "model.safetensors").write_bytes(b"\0" * 4096)
    (tmp / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": None}))
    return tmp


def test_configure_removes_what_a_killed_configure_left(tiny, tmp_path, capsys):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killed = _temporary(tmp_path, ".out.a1b2c3.tmp", _dead_pid())
        running = _temporary(tmp_path, ".out.d4e5f6.tmp", alive.pid)  # another configure, still copying
        assert main(["configure", str(tiny), "--method", "yarn", "--factor", "2", "--out", str(tmp_path / "out")]) == 0
        assert not killed.exists() and running.exists()
        assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["factor"] == 2
        assert not (tmp_path / "out" / locking.LOCK).exists()  # its lock lives beside it, and is gone after
        assert not (tmp_path / f".out{locking.LOCK}").exists()
    finally:
        alive.kill()
        alive.wait()


def _earlier_card(out: Path) -> None:
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"kind": "card", "tool": "rope-extend"}))
    (out / "records.jsonl").write_text('{"old": true}\n')
    (out / "card.md").write_text("the earlier card\n")


def test_card_overwrite_replaces_an_earlier_card(tmp_path, monkeypatch):
    from rope_extend.evaluation import card

    out = tmp_path / "c"
    _earlier_card(out)

    class Measured(Exception):
        pass

    def measure(*args, **kwargs):
        assert sorted(p.name for p in out.iterdir()) == [MARKER, locking.LOCK]  # the earlier records are gone
        raise Measured

    monkeypatch.setattr(card, "measure", measure)
    argv = ["card", "bundled", "--method", "yarn", "--factor", "4", "--lengths", "256,512", "--answer-tokens", "16"]
    argv += ["--tasks", "niah_single_1"]
    argv += ["--samples", "1", "--trials", "1", "--docs", "1", "--no-engine", "--out", str(out)]
    assert main(argv) == 2  # without --overwrite (or --resume): refused, the earlier card kept
    assert (out / "records.jsonl").read_text() == '{"old": true}\n'
    with pytest.raises(Measured):
        main([*argv, "--overwrite"])


def test_card_into_an_eval_folder_names_the_eval_run(tmp_path, capsys):
    out = tmp_path / "e"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"kind": "eval", "tool": "rope-extend"}))
    for name in ("records.jsonl", "report.md", "results.json"):
        (out / name).write_text("{}\n")
    before = _snapshot(tmp_path)
    for flag in ([], ["--resume"], ["--overwrite"]):
        capsys.readouterr()
        assert main(["card", "bundled", "--out", str(out), *flag]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out} holds the output of a rope-extend eval run, not a card run" in err
    assert _snapshot(tmp_path) == before
