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


def test_cancel_phases_are_exactly_the_documented_ones() -> None:
    """The harness's CANCEL_PHASES names exactly the phases its docstring
    documents (each `- "phase":` item), plus None for "no cancel"."""
    from kvhandoff.actors import _phases

    doc = inspect.getdoc(_phases) or ""
    documented = set(re.findall(r'^- "([a-z_]+)":', doc, flags=re.MULTILINE))
    assert documented, "the harness's docstring lists no cancel phase"
    assert None in _phases.CANCEL_PHASES
    assert len(set(_phases.CANCEL_PHASES)) == len(_phases.CANCEL_PHASES)
    assert set(_phases.CANCEL_PHASES) - {None} == documented


def test_test_hooks_are_not_in_the_public_api() -> None:
    """Cancel phases, frame holds and posted-chunk polls live in the harness
    (actors/_phases.py), not in `Deployment` or the rank actor's methods."""
    params = inspect.signature(actors.Deployment.handoff).parameters
    assert set(params) == {"self", "request_id", "num_tokens", "timeout"}, params
    from kvhandoff.actors.rank import RankCore

    assert hasattr(RankCore, "receive_frame")  # the check below can fail
    for name in ("hold_frames", "send_opens", "cancel_at", "_until_posted"):
        assert not hasattr(RankCore, name) and not hasattr(actors.Deployment, name), name
    assert not hasattr(actors, "CANCEL_PHASES")


@pytest.mark.parametrize("phase", ["mid-dma", "MID_DMA", "", "never", 3])
def test_harness_refuses_an_unknown_cancel_phase_before_any_actor_call(phase: object) -> None:
    """An unknown phase raises ValueError naming the valid ones before any
    call: a deployment that was never launched would fail any call, so
    reaching one would show up here as a different error."""
    from kvhandoff.actors._phases import handoff_cancel_at

    deployment = actors.Deployment()
    with pytest.raises(ValueError, match="phase must be one of") as info:
        asyncio.run(handoff_cancel_at(deployment, "req-1", 16, phase))  # type: ignore[arg-type]
    assert repr(phase) in str(info.value)
    assert not deployment._recent  # no attempt was recorded
