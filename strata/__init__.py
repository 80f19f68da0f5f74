"""Strata: distributed multi-worker training for TensorFlow, as a service.

Installed, the repository's top-level directories are subpackages of this one namespace:
``strata.coordinator`` (coordinator/), ``strata.worker`` (worker/), ``strata.protos`` (protos/),
next to the shared library in strata/ itself (pyproject.toml maps them). Run from a source
checkout without installing, the same names resolve through ``__path__`` below, so
``python -m strata.worker.task`` works either way.
"""

from __future__ import annotations

import os as _os

# gRPC's fork handlers restart its poller in a forked child; with a channel busy in another
# thread, a child that closes its descriptors before exec then aborts ("epoll_wait error: Bad
# file descriptor", grpc/grpc#43055; here 2 of 1,000 Popen children with a preexec_fn, 0 of
# 1,000 with this off). Every process Strata starts execs at once and needs no fork support,
# so it is off unless the environment says otherwise. gRPC reads it when it initialises:
# hence here, before anything of Strata imports grpc.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

try:
    from importlib.metadata import PackageNotFoundError as _NotFound, version as _version

    __version__ = _version("strata-training")
except _NotFound:  # a source checkout that was never installed
    __version__ = "0+unknown"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and \
        _os.path.isdir(_os.path.join(_root, "coordinator")):
    __path__.append(_os.path.join(_root))  # noqa: F821 - a package's own __path__
