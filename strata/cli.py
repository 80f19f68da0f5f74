# PYTHON_ARGCOMPLETE_OK
"""The ``strata`` command line.

Exit codes: 0 success; 1 the job FAILED or was CANCELLED, or the command failed; 2 bad usage or a
rejected job spec (the message names the field or flag); 3 the coordinator cannot be reached;
4 no such job or task; 124 ``strata wait --timeout`` ran out.

Shell completion: ``eval "$(register-python-argcomplete strata)"`` (argcomplete).

The commands are in ``strata.clicluster``, ``strata.clijobs`` and ``strata.clioffline``, what
they share in ``strata.clicommon``, their flags in ``strata.cliparser``.
"""

from __future__ import annotations

import os
import sys

from strata.clicommon import (
    EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, UsageError, _fail,
)
from strata.cliparser import build_parser


def main(argv: list[str] | None = None) -> int:
    from strata.client import (
        CoordinatorError, DiskFull, Infeasible, JobRejected, NotFound, Unavailable,
    )
    from strata.errors import SpecError

    parser = build_parser()
    try:
        import argcomplete

        argcomplete.autocomplete(parser)  # `eval "$(register-python-argcomplete strata)"`
    except ImportError:
        pass
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        return _fail(str(e), EXIT_USAGE)
    except SpecError as e:
        return _fail(f"job spec rejected: {e}", EXIT_USAGE)
    except JobRejected as e:
        return _fail(f"job spec rejected: {e.message}", EXIT_USAGE)
    except Infeasible as e:
        if args.command == "submit":
            return _fail(f"job rejected: {e.message}", EXIT_USAGE)
        return _fail(e.message, EXIT_FAILED)
    except NotFound as e:
        return _fail(e.message, EXIT_NOT_FOUND)
    except DiskFull as e:  # reached, but it cannot store this: not "unreachable"
        return _fail(e.message, EXIT_FAILED)
    except Unavailable as e:
        return _fail(e.message, EXIT_UNAVAILABLE)
    except CoordinatorError as e:
        return _fail(e.message, EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        # the reader went away (`strata logs ... | head`): end quietly; stdout is pointed at
        # /dev/null so that the interpreter's last flush does not complain either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (OSError, RuntimeError, TimeoutError) as e:
        return _fail(str(e) or type(e).__name__, EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
