"""What a run prints: under torchrun only rank 0 prints warnings (every rank runs the same checks on
the same recipe and data, so each warning came once per rank), and every rank prints its errors."""

from __future__ import annotations

import logging
import warnings

from automodel.console import configure_console


def test_a_rank_other_than_0_prints_its_errors_only(capfd):
    log = logging.getLogger("automodel")
    try:
        configure_console(is_main=False)
        log.warning("the same warning on every rank")
        warnings.warn("a library's warning on every rank", UserWarning, stacklevel=1)
        log.error("this rank's own failure")
        printed = capfd.readouterr().err
        assert "this rank's own failure" in printed
        assert "on every rank" not in printed, printed
        configure_console(is_main=True)
        log.warning("said once, by rank 0")
        assert "said once, by rank 0" in capfd.readouterr().err
    finally:
        logging.captureWarnings(False)
