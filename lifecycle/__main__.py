import sys

if "run" in sys.argv[1:]:  # a stop signal from the first instruction on is recorded and honoured, never fatal
    from lifecycle.machine.stops import record_early

    record_early()

from lifecycle.cli import console  # noqa: E402 - after the signals are recorded

console()
