"""evaluation.runner: the progress bar in a log (issue 55: each update was printed twice when not on a tty)."""

from __future__ import annotations

import re
import time

from rope_extend.evaluation import runner
from tests.tiny import tiny_model


def test_progress_prints_each_job_once_when_not_a_tty(capsys):
    def measure(job):
        time.sleep(0.15)  # past tqdm's 0.1 s minimum interval, so every update is drawn
        return {"correct": True}

    jobs = [{"length": n} for n in (16, 32, 48)]
    runner.run(tiny_model("llama"), task="toy", setting={}, jobs=jobs, measure=measure, longest=48, progress=True)
    err = capsys.readouterr().err  # captured: not a tty
    states = [m.group(1) for m in re.finditer(r"(\d)/3", err)]
    assert states[-2:] == ["3", "3"], err  # tqdm's close draws the finished bar once more, with the overall rate
    states = states[:-1]
    assert len(states) == len(set(states)) == 4, err  # before that, no bar state drawn twice
    assert "length=48" in err
