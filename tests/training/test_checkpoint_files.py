"""Resuming reads what a run saved as hostile: a damaged, huge, linked or piped run_config.yaml or
trainer_state.json is one line (exit 2) before anything loads, and the run's folder is left as it was."""

import os
import shutil
from pathlib import Path

import pytest

from rope_extend import resources
from rope_extend.cli import main
from rope_extend.training import train
from tests.training.test_loop import FAST, run_args

RECIPE = resources.RECIPES / "tiny-cpu.yaml"
STEPS = ["max_steps=2", "save_steps=2", "merge_adapter=false"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A real run's folder: its recipe (run_config.yaml) and checkpoint-2."""
    root = tmp_path_factory.mktemp("saved")
    train(run_args(root, *STEPS))
    assert (root / "run" / "checkpoint-2" / "trainer_state.json").is_file()
    return root / "run"


def copy_run(saved: Path, tmp_path: Path) -> Path:
    """A copy of the saved run at ``tmp_path / 'run'``, its recipe naming it (its output_dir) as the run's did."""
    out = tmp_path / "run"
    shutil.copytree(saved, out, symlinks=True)
    recipe = out / "run_config.yaml"
    recipe.write_text(recipe.read_text().replace(str(saved), str(out)))
    return out


def snapshot(folder: Path) -> dict:
    """Every entry under ``folder`` (links not followed): a file's bytes, a link's target, a pipe as such."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_fifo():
            out[rel] = ("fifo",)
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def _huge(path: Path) -> None:
    path.unlink()
    path.write_bytes(b"")
    os.truncate(path, 8 << 20)  # sparse: past read_yaml's 4 MiB, never read


def _linked(path: Path) -> None:
    """The run's own content, but through a link to a file outside the run: never read through."""
    outside = path.parents[2] / f"outside-{path.name}"
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


RUN_CONFIG = {
    "not yaml": (lambda p: p.write_text("max_steps: [1\n"), "is not valid YAML"),
    "huge": (_huge, "is larger than 4194304 bytes: rope-extend saves the recipe there"),
    "link": (_linked, "is a symbolic link: rope-extend never reads a file it wrote through a link"),
    "fifo": (_fifo, "is a named pipe, not a regular file"),
    "key twice": (lambda p: p.write_text(p.read_text() + "max_steps: 9\n"), "the key 'max_steps' is given twice"),
    "a list": (lambda p: p.write_text("- max_steps\n"), "expected a mapping of keys at the top, got list"),
    "5000 digits": (lambda p: p.write_text(f"max_steps: {'1' * 5000}\n"), "an integer of 5000 digits"),
}
STATE = {
    "cut": (lambda p: p.write_bytes(p.read_bytes()[:20]), "is not valid JSON"),
    "link": (_linked, "is a symbolic link"),
    "a list": (lambda p: p.write_text("[1, 2]"), "holds a list, not a JSON object"),
    "deep": (lambda p: p.write_text("[" * 100_000), "is nested too deeply to be read as JSON"),
}


def resume(out: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["train", str(RECIPE), *FAST, f"output_dir={out}", *STEPS, "resume_from_checkpoint=true"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("damage", list(RUN_CONFIG))
def test_a_damaged_saved_recipe_is_one_line_and_the_run_is_unchanged(saved_run, tmp_path, capsys, damage):
    out = copy_run(saved_run, tmp_path)
    plant, said = RUN_CONFIG[damage]
    plant(out / "run_config.yaml")
    before = snapshot(out)
    code, err = resume(out, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"the saved recipe {out / 'run_config.yaml'}" in err and said in err, err
    assert snapshot(out) == before


@pytest.mark.parametrize("damage", list(STATE))
def test_a_damaged_trainer_state_is_one_line_and_the_run_is_unchanged(saved_run, tmp_path, capsys, damage):
    out = copy_run(saved_run, tmp_path)
    plant, said = STATE[damage]
    state = out / "checkpoint-2" / "trainer_state.json"
    plant(state)
    before = snapshot(out)
    code, err = resume(out, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{state} {said}" in err and "resume from another checkpoint, or start again" in err, err
    assert snapshot(out) == before


def test_the_same_run_undamaged_resumes(saved_run, tmp_path, capsys):
    """The control: the copy itself resumes (exit 0), so each refusal above is the planted file's."""
    out = copy_run(saved_run, tmp_path)
    code, err = resume(out, capsys)
    assert code == 0, err
