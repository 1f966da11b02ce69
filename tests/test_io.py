"""Output folders: claim_output_dir never loses what a user made, and a run that wrote nothing blocks nothing."""

import pytest

from rope_extend.errors import RopeExtendError
from rope_extend.io import MARKER, claim_output_dir
from rope_extend.locking import LOCK


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
