"""Run many ``luopan`` CLI commands in one process and report each outcome as JSON (for the CLI matrix test).

    python tests/cli_driver.py '<json: {"commands": [[arg, ...], ...], "timeout": seconds}>'

Each command runs in-process through typer's CliRunner, so one interpreter start serves a whole row of the matrix;
a command that blocks (e.g. on a FIFO) is interrupted by SIGALRM after ``timeout`` seconds and reported as hung.
The result of each command: exit code, stdout, stderr, and the type and traceback of any exception that was not a
clean exit (a luopan bug). The process ends with ``os._exit`` so a thread stuck on a FIFO cannot keep it alive.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback


class Hung(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hung()


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["COLUMNS"] = "200"
    from typer.testing import CliRunner

    from luopan.cli.main import app

    runner = CliRunner()
    results = []
    signal.signal(signal.SIGALRM, _alarm)
    for args in spec["commands"]:
        start = time.monotonic()
        signal.alarm(int(spec.get("timeout", 30)))
        try:
            res = runner.invoke(app, args, catch_exceptions=True)
            hung = isinstance(res.exception, Hung)
        except Hung:
            res, hung = None, True
        finally:
            signal.alarm(0)
        item = {"args": args, "seconds": round(time.monotonic() - start, 3), "hung": hung}
        if res is not None:
            exc = res.exception if res.exception is not None and not isinstance(res.exception, SystemExit) else None
            item.update(exit_code=res.exit_code, stdout=res.stdout, stderr=res.stderr,
                        exception=None if exc is None else type(exc).__name__,
                        traceback=None if exc is None else "".join(traceback.format_exception(exc)))
        results.append(item)
    sys.stdout.write(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
