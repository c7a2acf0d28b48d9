"""A SIGTERM sent at a chosen call of a chosen function of automodel, as a scheduler's preemption
lands there: the script run in a fresh interpreter as ``python sigterm_at.py module[:Class].function@call
COMMAND ARGS...`` (the tests of test_preemption.py and the battery in faults_battery.py)."""

SIGTERM_AT = """
import functools, importlib, os, signal, sys
from automodel.cli import main

point, at = sys.argv[1].split("@")
owner, name = point.rsplit(".", 1)
module, _, attribute = owner.partition(":")
holder = importlib.import_module(module)
holder = getattr(holder, attribute) if attribute else holder
real, calls = getattr(holder, name), []


@functools.wraps(real)
def signalled(*args, **kwargs):  # a scheduler's SIGTERM arrives here, at its call number `at`
    calls.append(1)
    if len(calls) == int(at):
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)


setattr(holder, name, signalled)
sys.exit(main(sys.argv[2:]))
"""
