"""The calls in flight, by the credential that made them (``OpenCalls``), and revoking
credentials (``Revocations``): their open calls end with PERMISSION_DENIED and the agents
registered with them are LOST. Revoked names are kept in the store across restarts."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable

import grpc

from strata.auth import Auth, Caller

if TYPE_CHECKING:
    from strata.coordinator.core import Coordinator

log = logging.getLogger("strata.coordinator")


class OpenCalls:
    """The calls in flight, by the credential that made them, so that revoking a credential
    ends its calls at once: a stream open for hours (heartbeats, commands, a followed log)
    is closed with PERMISSION_DENIED the moment its credential goes, as a new call is
    refused. Each call is its handler's asyncio task; revoking cancels the task, and the
    handler's wrapper (``rpcguard.rpc``) turns that cancellation into the refusal."""

    def __init__(self) -> None:
        #: each call's credential, and the agent it acts as (cluster API; "" until known)
        self._calls: dict[asyncio.Task[Any], tuple[Caller, str]] = {}
        self._revoked: dict[asyncio.Task[Any], str] = {}

    def enter(self, caller: Caller | None, agent: str = "") -> asyncio.Task[Any] | None:
        task = asyncio.current_task() if caller is not None else None
        if task is not None and caller is not None:
            self._calls[task] = (caller, agent)
        return task

    def acting_as(self, agent: str) -> None:
        """The current call acts as agent ``agent`` (a stream's messages name it)."""
        task = asyncio.current_task()
        entry = self._calls.get(task) if task is not None else None
        if entry is not None and entry[1] != agent:
            self._calls[task] = (entry[0], agent)  # type: ignore[index]

    def leave(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._calls.pop(task, None)
            self._revoked.pop(task, None)

    def __len__(self) -> int:
        return len(self._calls)

    def revoke(self, match: Callable[[Caller, str], bool], why: str) -> int:
        """Ends every call whose caller (and the agent it acts as) ``match``; returns how
        many."""
        n = 0
        for task, (caller, agent) in list(self._calls.items()):
            if task not in self._revoked and match(caller, agent):
                self._revoked[task] = f"the credentials of {caller.name} were revoked ({why})"
                task.cancel()
                n += 1
        return n

    async def refuse_if_revoked(self, task: asyncio.Task[Any] | None, context: Any) -> None:
        """Called on a handler's cancellation: a revoked call answers PERMISSION_DENIED (its
        cancellation was ours, and is taken back); any other passes on."""
        why = self._revoked.get(task) if task is not None else None
        if why is None:
            return
        uncancel = getattr(task, "uncancel", None)  # (Python 3.11+)
        if uncancel is not None:
            uncancel()
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)



class Revocations:
    """Revoking credentials, at once: the calls they have open end (``OpenCalls``) and the
    agents registered with them are LOST, their tasks restarted elsewhere as a lost agent's
    are. By key (a token removed from ``--auth-tokens``, SIGHUP) or by NAME (``strata admin
    revoke``, every token and certificate of the name, kept in the store across restarts)."""

    def __init__(self, auth: Auth, calls: OpenCalls, coord: Coordinator):
        self.auth, self.calls, self.coord = auth, calls, coord
        auth.set_revoked(coord.store.load_revoked())

    def _close(self, match: Callable[[Caller, str], bool], why: str) -> tuple[int, list[str]]:
        closed = self.calls.revoke(match, why)
        lost = self.coord.revoke_agents(match, why)
        if closed or lost:
            log.warning("revoked (%s): %d open call(s) closed, agent(s) lost: %s", why, closed,
                        ", ".join(lost) or "none")
        return closed, lost

    def keys(self, keys: set[str], why: str) -> tuple[int, list[str]]:
        return self._close(lambda c, _agent: c.key in keys, why) if keys else (0, [])

    def name(self, name: str) -> tuple[int, list[str]]:
        self.coord.store.put_revoked(name, self.coord.clock())
        self.auth.revoked.add(name)
        # the name's own credentials, and whatever acts as the agent of that name (a
        # cluster-wide agent certificate acting as it)
        return self._close(lambda c, agent: c.name == name or agent == name,
                           "strata admin revoke")

    def restore(self, name: str) -> None:
        self.coord.store.delete_revoked(name)
        self.auth.revoked.discard(name)
