"""StopOnSignal with real signals sent to this process (os.kill): the first is recorded, the same one
again within the window counts once, a second one stops at once, an ignored one stays ignored, and
the previous handlers come back."""

from __future__ import annotations

import os
import signal
import time

import pytest

from automodel.training.signals import REPEAT_WINDOW_S, StopOnSignal, TrainingStopped


@pytest.fixture(autouse=True)
def ctrl_c_as_on_a_terminal():
    """Python's own Ctrl-C handler, as in a terminal (a shell starts background jobs ignoring SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_first_signal_is_recorded_and_its_repeat_within_the_window_counts_once():
    previous = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.agreed() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's forwarded copy: this process lives on
        assert stop.agreed() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_second_ctrl_c_after_the_window_stops_at_once():
    with StopOnSignal() as stop, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        time.sleep(REPEAT_WINDOW_S + 0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler raises at the next bytecode, well before this ends
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_another_signal_is_a_second_one_at_once():
    with StopOnSignal(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


def test_an_ignored_signal_stays_ignored_and_disabled_changes_nothing():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
    try:
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert stop.received is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    with StopOnSignal(enabled=False) as stop:
        assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_the_stop_names_the_signal_step_and_checkpoint_and_its_exit_code():
    stopped = TrainingStopped(signal.SIGTERM, 7, "runs/x/checkpoints/step_00000007")
    assert str(stopped) == (
        "stopped by SIGTERM after step 7; checkpoint runs/x/checkpoints/step_00000007 written: run the same "
        "command to resume from it"
    )
    assert (stopped.exit_code, TrainingStopped(signal.SIGINT, 1, "c").exit_code) == (143, 130)


def test_a_second_sigterm_after_the_window_stops_at_once_as_terminated():
    """Was SIGTERM's default action: the process killed, exit -15, no word. Now the CLI's one line, 143."""
    from automodel.errors import Terminated

    with StopOnSignal() as stop, pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        time.sleep(REPEAT_WINDOW_S + 0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
