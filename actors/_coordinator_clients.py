"""The coordinator's client channels (part of `CoordinatorCore`,
actors/_coordinator.py): a client's submissions over TCP instead of Ray
calls. `CoordinatorCore` inherits it as `ClientsMixin`.

A GEN coordinator of an instance whose control frames go by stream serves
clients on a `CallServer` of its own (actors/_channel.py), started on the
first `submit_address` call: only a holder of the coordinator's actor handle
learns its token. Over a connection a client calls `submit`, one message per
handoff (those of one turn of the client's loop go in one send), and the
answer comes when the decision that ends the handoff is made, as
`submit`'s return over Ray would: the outcome, or the very error `submit`
raises (`WIRE_ERRORS`). Everything else a client asks stays a Ray call, and
a coordinator whose frames go by Ray answers `submit_address` with None:
its clients submit by Ray call (actors/_submit.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from kvhandoff.actors._channel import CallServer, Handler, late
from kvhandoff.actors._coordinator_state import CoordinatorState
from kvhandoff.actors._submit import SubmitRequest

__all__ = ["ClientsMixin"]

#: A `submit` message's arguments: one request, its fields checked as the
#: protocol's decoders check theirs (the coordinator then checks the values).
_SUBMIT_ARGS = msgspec.msgpack.Decoder(tuple[SubmitRequest])


def _node_address() -> str:
    """This node's address as Ray knows it (the client server listens there)."""
    import ray

    return str(ray.util.get_node_ip_address())


class ClientsMixin(CoordinatorState):
    """The client channels of `CoordinatorCore`: it owns the state declared here."""

    _client_channels: bool
    _clients: CallServer | None

    if TYPE_CHECKING:  # CoordinatorCore's
        async def _ensure_started(self) -> None: ...
        def _enter(self, request: SubmitRequest) -> Any: ...

    async def submit_address(self) -> tuple[str, int, str] | None:
        """(host, port, token) of this coordinator's client server (started
        on first use), or None when its clients submit by Ray call (its
        instance's frames do not go by stream)."""
        if not self._client_channels:
            return None
        if self._clients is None:
            handlers = {"submit": Handler(_SUBMIT_ARGS, late(self, "_submit_by_channel"))}
            self._clients = CallServer(_node_address, handlers, lambda _: None, self.calls)
        return await self._clients.address()

    async def _submit_by_channel(self, request: SubmitRequest) -> str:
        """`submit` of one request that came over a client channel."""
        self.calls["submit_by_channel"] += 1
        self.trace.record(request.parent.request_id, "submit", "channel", "client")
        await self._ensure_started()
        return str(await self._enter(request))

    def _close_clients(self) -> None:
        if self._clients is not None:
            self._clients.close()
