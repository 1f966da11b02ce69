"""evaluation.runner: the progress bar in a log (issue 55: each update was printed twice when not on a tty)."""

from __future__ import annotations

import re
import time

from rope_extend.evaluation import runner
from tests.tiny import tiny_model


def test_progress_in_a_log_prints_its_first_and_last_state_only(capsys):
    """Not a tty (a log): the bar draws on progress.LOG_INTERVAL's clock (30 s), so three jobs of 0.15 s each draw
    nothing between the bar's first state and its last, though each is past tqdm's own 0.1 s (issue 69: the demo's
    log was mostly bars); the length set for the last job shows in the last line."""

    def measure(job):
        time.sleep(0.15)  # past tqdm's 0.1 s minimum interval: tqdm's own bar would draw every update
        return {"correct": True}

    jobs = [{"length": n} for n in (16, 32, 48)]
    runner.run(tiny_model("llama"), task="toy", setting={}, jobs=jobs, measure=measure, longest=48, progress=True)
    err = capsys.readouterr().err  # captured: not a tty
    states = [m.group(1) for m in re.finditer(r"(\d)/3", err)]
    assert states == ["0", "3"], err
    assert "length=48" in err
