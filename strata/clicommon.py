"""What the ``strata`` commands share: exit codes, ``UsageError`` (a bad flag value, named),
readers of flag values (durations, sizes, addresses), the coordinator's client made from the
flags, the job file's parse under a time bound, and the plain formatting of sizes, JSON and
tables."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_NOT_FOUND = 0, 1, 2, 3, 4
#: `strata wait --timeout` ran out (as timeout(1) exits)
EXIT_TIMEOUT = 124


class UsageError(Exception):
    """A bad flag value; the message names the flag."""


def _fail(message: str, code: int) -> int:
    print(f"strata: {message}", file=sys.stderr)
    return code


def _duration(flag: str, text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s`` or plain seconds."""
    from strata.units import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise UsageError(f"{flag} {e}") from None


def _size(flag: str, text: str, zero: bool = False) -> int:
    """A size flag (``512MiB``, ``2GiB``, bytes); ``zero``: 0 is allowed (none, no limit)."""
    from strata.units import parse_size

    if zero and text.strip() == "0":
        return 0
    try:
        value = parse_size(text)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: {e}") from None
    if value <= 0:
        raise UsageError(f"{flag} must be positive" + (" (or 0)" if zero else ""))
    return value


def _address(flag: str, text: str, allow_port_zero: bool = False) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if allow_port_zero else 1) <= int(port) <= 65535:
        raise UsageError(f"{flag} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return text


def _token(args: argparse.Namespace) -> str:
    """``--token-file``, else ``STRATA_TOKEN`` (never a token on the command line)."""
    from strata.auth import read_token

    try:
        return read_token(args.token_file)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _client_tls(args: argparse.Namespace):
    """The TLS settings of a client or agent: its flags, else ``STRATA_TLS_*``."""
    from strata.tls import ClientTls, TlsError

    tls = ClientTls.from_env(args.tls_ca, args.tls_cert, args.tls_key)
    try:
        tls.check()
    except TlsError as e:
        raise UsageError(str(e)) from None
    return tls


def _client(args: argparse.Namespace):
    from strata.client import Client, default_address

    return Client(_address("--coordinator", args.coordinator or default_address()),
                  tls=_client_tls(args), token=_token(args))


#: seconds a job file and its --set flags may take to parse; a real one takes milliseconds
PARSE_LIMIT_S = 10.0


class _ParseTimeout(BaseException):
    """The parse's time is up. Not an Exception: no ``except Exception`` inside may keep it."""


def _check_job(job: Any, overrides: list[str] | None) -> None:
    """Parses the job file (or mapping) and the --set flags under a time bound before the
    client parses them again to send: the parser bounds what it knows of (aliases, depth,
    size), and this bounds what it does not, so a command never hangs on a file."""
    import threading

    from strata.errors import SpecError
    from strata.spec import apply_overrides, load_spec_file

    def parse() -> None:
        raw = load_spec_file(job) if isinstance(job, str) else dict(job)
        if overrides:
            apply_overrides(raw, overrides)

    if threading.current_thread() is not threading.main_thread():
        return parse()  # a timer's signal reaches the main thread only

    def expire(signum: int, frame: Any) -> None:
        raise _ParseTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        timer = signal.setitimer(signal.ITIMER_REAL, PARSE_LIMIT_S)
        try:
            parse()
        finally:
            signal.setitimer(signal.ITIMER_REAL, *timer)  # the caller's timer, if it had one
    except _ParseTimeout:
        raise SpecError("JOB", f"{job if isinstance(job, str) else 'the job'}: still parsing "
                               f"after {PARSE_LIMIT_S:g} s; a job file takes milliseconds, so "
                               "this one is refused") from None
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def _fmt_bytes(n: int | None) -> str:
    from strata.units import format_size

    return format_size(n) if n else "-"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
