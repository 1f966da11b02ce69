"""rope_extend.loading: what loading prints (issue 55: no ``Loading weights`` bar on every local load)."""

from __future__ import annotations

import pytest
from transformers.utils import logging as hf_logging

from rope_extend.loading import bundled_available, load_model

pytestmark = pytest.mark.skipif(not bundled_available(), reason="bundled model files not installed")


def test_local_load_prints_no_weights_bar_unless_asked(capfd):
    load_model("bundled")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # the user's setting is back after the load

    load_model("bundled", progress=True)
    assert "Loading weights" in capfd.readouterr().err


def test_load_keeps_bars_off_when_the_user_turned_them_off(capfd):
    hf_logging.disable_progress_bar()
    try:
        load_model("bundled")
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
