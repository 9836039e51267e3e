"""Joining a Ray cluster at an explicit address: fail fast, in one line.

`kvhandoff demo --address HOST:PORT` (and `bench`, and RAY_ADDRESS) hand the
address to `ray.init`, which, when nothing Ray listens there, retries the GCS
20 times, each attempt a 5 s connect, a 5 s pubsub connect and a 30 s wait for
the cluster ID (`ray._private.node.Node._init_gcs_client`): about 14 minutes
and a few dozen warnings from Ray's C++ core on stderr. `check_join` (called by
`cli.main` before Ray is imported) answers instead, in one line:

1. `probe`: a plain TCP connect to the address (no Ray). Refused, unreachable
   or an unknown host is final at once; no answer is retried until a 20 s
   bound.
2. Something accepts connections: `bound_ray_connect` caps Ray's own GCS
   connect (RAY_py_gcs_connect_timeout_s, RAY_gcs_server_port_wait_time_s,
   each only when the user did not set it; Ray reads the first when it is
   imported), and `check_gcs` asks for the cluster ID with Ray's `GcsClient`,
   Ray's warnings on stderr held back: no answer as a Ray GCS (about 20 s), or
   a token the cluster refuses, is one line too.

The probe and `bound_ray_connect` import only the standard library.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

__all__ = [
    "bound_ray_connect",
    "check_gcs",
    "check_join",
    "host_port",
    "init_error",
    "join_address",
    "probe",
]

#: One TCP connect attempt.
PROBE_TIMEOUT_S = 5.0
#: All the attempts of one probe (only an attempt that got no answer is retried).
PROBE_BUDGET_S = 20.0
#: Ray's knobs for the GCS connect of `ray.init` and `GcsClient`, set when the
#: user did not: one attempt (Ray's default: 20) whose wait for the cluster ID
#: is 10 s (default: 30), after the two 5 s connects. Ray reads
#: RAY_py_gcs_connect_timeout_s once, when it is imported.
RAY_CONNECT_BOUNDS = {
    "RAY_py_gcs_connect_timeout_s": "10",
    "RAY_gcs_server_port_wait_time_s": "1",
}
#: Ray Client's port when a ray:// address names none.
RAY_CLIENT_PORT = 10001
AUTH_HINT = (
    "a cluster with token authentication needs RAY_AUTH_MODE=token and its token "
    "in RAY_AUTH_TOKEN or ~/.ray/auth_token"
)


def join_address(args: argparse.Namespace, environ: MutableMapping[str, str]) -> tuple[str, str] | None:
    """The cluster the command will join, and where the address came from
    ("" for --address, " from RAY_ADDRESS"); None when it starts a local cluster
    or lets Ray find one ("auto", "local")."""
    address = getattr(args, "address", None)
    source = ""
    if not address:
        address, source = environ.get("RAY_ADDRESS", ""), " from RAY_ADDRESS"
    address = address.strip()
    if not address or address in ("auto", "local"):
        return None
    return address, source


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of "HOST:PORT", "[V6]:PORT" or "ray://HOST[:PORT]"; None
    for anything else (Ray judges an address that cannot be probed)."""
    client = address.startswith("ray://")
    rest = address[len("ray://"):] if client else address
    if "/" in rest:  # another scheme, or a path
        return None
    if client and not re.search(r":[0-9]+$", rest):
        rest = f"{rest}:{RAY_CLIENT_PORT}"
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 address without brackets: which colon ends it?
        return None
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def probe(
    host: str,
    port: int,
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
    budget_s: float = PROBE_BUDGET_S,
    connect: Callable[..., Any] = socket.create_connection,
    clock: Callable[[], float] = time.monotonic,
) -> str | None:
    """None when something accepts a TCP connection at host:port; else why not.

    A refused connection, an unreachable network or an unknown host is final
    at once; an attempt that gets no answer within `timeout_s` is retried
    while `budget_s` lasts."""
    deadline = clock() + budget_s
    while True:
        remaining = deadline - clock()
        try:
            conn = connect((host, port), timeout=max(0.1, min(timeout_s, remaining)))
        except ConnectionRefusedError:
            return "connection refused"
        except socket.gaierror as exc:
            return f"unknown host {host!r}: {exc.strerror or exc}"
        except TimeoutError:
            if clock() < deadline:
                continue
            return f"no answer within {budget_s:g} s"
        except OSError as exc:
            return (exc.strerror or str(exc)).lower()
        conn.close()
        return None


def bound_ray_connect(environ: MutableMapping[str, str]) -> None:
    """Cap Ray's GCS connect (`RAY_CONNECT_BOUNDS`) where the user set nothing."""
    for name, value in RAY_CONNECT_BOUNDS.items():
        environ.setdefault(name, value)


@contextmanager
def _stderr_held() -> Iterator[Callable[[], None]]:
    """Hold back what is written on file descriptor 2 (Ray's C++ core writes
    there directly); the yielded function lets it through after all."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield lambda: None
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        release = False

        def let_through() -> None:
            nonlocal release
            release = True

        try:
            yield let_through
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if release:
                held.seek(0)
                data = held.read()
                if data:
                    os.write(2, data)


def check_gcs(address: str, environ: MutableMapping[str, str], *, named: str | None = None) -> str | None:
    """None when a Ray GCS answers at `address` (it tells its cluster ID);
    else one line of why not, naming the address as `named`. Imports Ray;
    Ray's own lines on stderr are held back, and let through only when a GCS
    answered."""
    named = address if named is None else named
    start = time.monotonic()
    with _stderr_held() as let_through:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError

        try:
            GcsClient(address=address)
        except AuthenticationError:
            return (
                f"the Ray cluster at {named} refused the connection: authentication token "
                f"missing or incorrect ({_auth_hint(environ)})"
            )
        except Exception as exc:
            waited = time.monotonic() - start
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if "timed out" in first.lower():
                return (
                    f"no Ray cluster at {named} (it accepts connections, but no Ray GCS "
                    f"answered within {waited:.0f} s)"
                )
            return f"no Ray cluster at {named} ({first})"
        let_through()
    return None


def _auth_hint(environ: Mapping[str, str]) -> str:
    if environ.get("RAY_AUTH_MODE") == "token":
        return "the token in RAY_AUTH_TOKEN or ~/.ray/auth_token is not this cluster's"
    return AUTH_HINT


def init_error(exc: BaseException, where: str, environ: Mapping[str, str]) -> str:
    """One line for a `ray.init` that raised while joining the cluster at
    `where`: the exception's first line, and the token hint only when an
    exception of its chain is about authentication."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    line = f"could not join the Ray cluster at {where}: {first}"
    if any(
        type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e) for e in chain
    ):
        line += f" ({_auth_hint(environ)})"
    return line


def check_join(args: argparse.Namespace, environ: MutableMapping[str, str]) -> str | None:
    """None when the command starts a local cluster, or when a Ray cluster
    answers at the address it joins; else one line naming the address and why.

    Call it before Ray is imported: `bound_ray_connect` sets knobs Ray reads
    then."""
    joining = join_address(args, environ)
    if joining is None:
        return None
    address, source = joining
    target = host_port(address)
    if target is None:
        return None
    why = probe(*target)
    if why is not None:
        return f"no Ray cluster at {address}{source} ({why})"
    if address.startswith("ray://"):  # Ray Client: no GCS to ask; ray.init gives up after 30 s
        return None
    bound_ray_connect(environ)
    return check_gcs(address, environ, named=f"{address}{source}")
