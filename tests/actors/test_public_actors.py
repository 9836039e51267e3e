"""The actors layer's public surface (docs/design.md "Public contract")."""

import asyncio
import inspect
import re

import pytest

import kvhandoff.actors as actors


def test_public_names_exist() -> None:
    for name in actors.__all__:
        assert hasattr(actors, name), name
    for name in ("launch", "launch_sync", "handoff", "cancel", "stats", "shutdown"):
        assert callable(getattr(actors.Deployment, name)), name
    for name in ("launch", "handoff", "cancel", "add_instance", "drain", "instances", "stats", "shutdown"):
        assert callable(getattr(actors.Fleet, name)), name
    for name in ("create", "plan", "attach", "publish", "receive", "cancel", "returned", "drain", "reattach", "shutdown"):
        assert callable(getattr(actors.EngineFleet, name)), name
    assert callable(actors.EngineDeployment.reattach)


def test_cancel_phases_are_exactly_the_documented_ones() -> None:
    """The harness's CANCEL_PHASES names exactly the phases its docstring
    documents (each `- "phase":` item), plus None for "no cancel"."""
    from kvhandoff.cli import harness

    doc = inspect.getdoc(harness) or ""
    documented = set(re.findall(r'^- "([a-z_]+)":', doc, flags=re.MULTILINE))
    assert documented, "the harness's docstring lists no cancel phase"
    assert None in harness.CANCEL_PHASES
    assert len(set(harness.CANCEL_PHASES)) == len(harness.CANCEL_PHASES)
    assert set(harness.CANCEL_PHASES) - {None} == documented


def test_test_hooks_are_not_in_the_public_api() -> None:
    """Cancel phases, frame holds and posted-chunk polls live in the harness
    (cli/harness.py), not in `Deployment` or the rank actor's methods."""
    params = inspect.signature(actors.Deployment.handoff).parameters
    assert set(params) == {"self", "request_id", "num_tokens", "timeout"}, params
    from kvhandoff.actors.rank import CtxRankCore, GenRankCore, RankCore

    for core in (RankCore, CtxRankCore, GenRankCore):
        assert hasattr(core, "receive_frame")  # the check below can fail
        for name in ("hold_frames", "send_opens", "cancel_at", "_until_posted"):
            assert not hasattr(core, name) and not hasattr(actors.Deployment, name), (core, name)
    assert not hasattr(actors, "CANCEL_PHASES")


def test_rank_actor_classes_are_split_by_role() -> None:
    """One rank actor class per role over a common base: the role-specific
    entry points exist only on their role's class, the role is the class's
    (not a branch), and `RankActor` picks the class by the config's role."""
    from kvhandoff.actors.rank import (
        CtxRankActor,
        CtxRankCore,
        GenRankActor,
        GenRankCore,
        RankCore,
        rank_actor_class,
    )
    from kvhandoff.protocol import Role

    assert issubclass(CtxRankCore, RankCore) and issubclass(GenRankCore, RankCore)
    assert (CtxRankCore.role, CtxRankCore.peer_role) == (Role.CTX, Role.GEN)
    assert (GenRankCore.role, GenRankCore.peer_role) == (Role.GEN, Role.CTX)
    for name in ("_post", "_plan_chunks", "_prefill"):
        assert hasattr(CtxRankCore, name) and not hasattr(GenRankCore, name), name
        assert not hasattr(RankCore, name), name
    for name in ("free", "_open", "_open_later", "_verify", "_ctx_endpoints"):
        assert hasattr(GenRankCore, name) and not hasattr(CtxRankCore, name), name
        assert not hasattr(RankCore, name), name
    assert rank_actor_class(Role.CTX) is CtxRankActor
    assert rank_actor_class(Role.GEN) is GenRankActor


@pytest.mark.parametrize("phase", ["mid-dma", "MID_DMA", "", "never", 3])
def test_harness_refuses_an_unknown_cancel_phase_before_any_actor_call(phase: object) -> None:
    """An unknown phase raises ValueError naming the valid ones before any
    call: a deployment that was never launched would fail any call, so
    reaching one would show up here as a different error."""
    from kvhandoff.cli.harness import handoff_cancel_at

    deployment = actors.Deployment()
    with pytest.raises(ValueError, match="phase must be one of") as info:
        asyncio.run(handoff_cancel_at(deployment, "req-1", 16, phase))  # type: ignore[arg-type]
    assert repr(phase) in str(info.value)
    assert not deployment._recent  # no attempt was recorded


def test_an_endpoint_host_forwards_every_endpoint_method_and_no_hook() -> None:
    """What peers, coordinators and clients call on a rank's actor handle is
    on every `EndpointHost` (an engine's own actor included), forwarded to
    the endpoint it hosts; test hooks are not."""
    import asyncio

    from kvhandoff.actors.rank import ENDPOINT_METHODS, CtxRankCore, EndpointHost, GenRankCore

    for needed in ("receive_frames", "round_vote", "round_apply", "round_identity", "connect",
                   "peer_restarted", "peer_dead", "stats", "wait", "returned", "free"):
        assert needed in ENDPOINT_METHODS, needed
        assert inspect.iscoroutinefunction(getattr(EndpointHost, needed)), needed
    for name in ENDPOINT_METHODS:
        assert hasattr(CtxRankCore, name) or hasattr(GenRankCore, name), name
        assert not name.startswith("_")
    for hook in ("hold_frames", "release_frames", "defer_opens", "cancel_at"):
        assert hook not in ENDPOINT_METHODS and not hasattr(EndpointHost, hook), hook
    # The bench's baselines run inside a rank from outside (kvhandoff.cli._baselines):
    # no rank class, core or host, has a method for them.
    from kvhandoff.actors.rank._host import _CtxRankHost, _GenRankHost

    for baseline in ("raw_write", "raw_contiguous", "copy_bench", "transfer_timings"):
        for cls in (EndpointHost, _CtxRankHost, _GenRankHost, CtxRankCore, GenRankCore):
            assert not hasattr(cls, baseline), (cls, baseline)

    class Endpoint:
        async def stats(self) -> str:
            return "forwarded"

    host = EndpointHost()
    host.kvhandoff = Endpoint()  # type: ignore[assignment]
    assert asyncio.run(host.stats()) == "forwarded"


def test_production_classes_carry_no_test_hook() -> None:
    """Fault injection is injected at construction (actors/_faults.py) and the
    bench's baselines run from outside (kvhandoff.cli._baselines): no runtime
    module but _faults.py names a hook, and the directory has no method for one."""
    import pathlib

    from kvhandoff.actors._directory import DirectoryCore

    root = pathlib.Path(__file__).resolve().parents[2]
    hooks = ("_held", "_defer_open", "_progress_until", "set_lookup_delay", "_drop_acks",
             "raw_write", "raw_contiguous", "copy_bench", "_bench")
    runtime = [p for d in ("actors", "integrations") for p in (root / d).rglob("*.py") if p.name != "_faults.py"]
    assert len(runtime) > 20
    for path in runtime:
        text = path.read_text()
        for hook in hooks:
            assert hook not in text, (path.name, hook)
    assert not hasattr(DirectoryCore, "set_lookup_delay")
