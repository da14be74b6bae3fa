"""``hplan``: the command line. A thin click layer: parse, call one library function, print.

Each command lives in its own module of this package; this one holds the group, the error
handling every command shares, and the console-script entry point. Human output goes to
stderr (rich); machine output (``--json``) and requested artifacts (``hplan show``) go to
stdout. Exit codes: 0 ok, 2 usage or invalid input, 3 infeasible, 4 environment, 1 anything
else. Errors are one line, never a traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import click

from hplan.planner.cli.bandwidth import bandwidth
from hplan.planner.cli.calibrate import calibrate_command
from hplan.planner.cli.capture import capture
from hplan.planner.cli.console import stderr
from hplan.planner.cli.devices import devices
from hplan.planner.cli.metrics import metrics
from hplan.planner.cli.profile import profile
from hplan.planner.cli.replan import replan
from hplan.planner.cli.run import rehearse_command, run
from hplan.planner.cli.show import show
from hplan.planner.cli.simulate import simulate_command
from hplan.planner.cli.solve import solve_command
from hplan.runtime.contract.errors import HplanError, Terminated, report_internal_error


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="hplan")
def cli() -> None:
    """hplan: plan and run PyTorch training on heterogeneous GPU pools.

    \b
    Typical use:
      hplan solve model.py --cluster cluster.yaml -o out/   # plan + launch scripts
      hplan capture model.py -o capture.json               # capture once, then
      hplan solve model.py -c other.yaml --capture capture.json   # solve many clusters
      hplan show out/plan.json                             # what was planned, and why
      hplan rehearse out/plan.json --steps 20              # run every rank here, emulated
      bash out/launch/node-<name>.sh --metrics-dir runs/   # on each real node
      hplan metrics runs/ --plan out/plan.json             # the run against the plan
      hplan replan out/plan.json -c cluster.yaml --without box-b   # a node is lost
      hplan devices                                        # the device types cluster.yaml names

    Loading model.py executes it, with your rights.
    """


for _command in (
    capture,
    solve_command,
    replan,
    show,
    run,
    rehearse_command,
    bandwidth,
    profile,
    simulate_command,
    calibrate_command,
    metrics,
    devices,
):
    cli.add_command(_command)


def _one_line(message: str) -> str:
    """Collapse whitespace so an error is exactly one line (library messages may wrap)."""
    return " ".join(message.split())


def _exit_on_signal(signum: int, _frame: object) -> None:
    """SIGTERM / SIGHUP handler: unwind like Ctrl-C, so that ``finally`` blocks stop child
    processes."""
    raise Terminated(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: maps hplan errors to one line and an exit code.

    SIGTERM (and SIGHUP: a closed terminal, a dropped ssh session) raises ``SystemExit(128 +
    signal)`` in the main thread, so a terminated ``hplan rehearse`` (or ``solve``) runs its
    clean-up and stops the processes it started.
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _exit_on_signal)
    code = _invoke(lambda: cli.main(args=argv, prog_name="hplan", standalone_mode=False))
    sys.exit(code)


def _invoke(call: Callable[[], Any]) -> int:
    try:
        result = call()
    except HplanError as exc:
        print(f"hplan: error: {_one_line(str(exc))}", file=sys.stderr, flush=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.UsageError as exc:  # one line, like every other error (click shows three)
        command = exc.ctx.command_path if exc.ctx is not None else "hplan"
        stderr.print(
            f"hplan: error: {exc.format_message().rstrip('.')} (see `{command} --help`)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        stderr.print("hplan: aborted")
        return 130
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        stderr.print("hplan: terminated")
        return exc.code if isinstance(exc.code, int) else 143
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        return report_internal_error(exc, "hplan")
    return result if isinstance(result, int) else 0
