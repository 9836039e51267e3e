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
    """CANCEL_PHASES names exactly the phases `Deployment.handoff` documents
    (each `- "phase":` item of its docstring), plus None for "no cancel"."""
    doc = inspect.getdoc(actors.Deployment.handoff) or ""
    documented = set(re.findall(r'^- "([a-z_]+)":', doc, flags=re.MULTILINE))
    assert documented, "handoff's docstring lists no cancel phase"
    assert None in actors.CANCEL_PHASES
    assert len(set(actors.CANCEL_PHASES)) == len(actors.CANCEL_PHASES)
    assert set(actors.CANCEL_PHASES) - {None} == documented


@pytest.mark.parametrize("phase", ["mid-dma", "MID_DMA", "", "never", 3])
def test_handoff_refuses_an_unknown_cancel_phase_before_any_actor_call(
    phase: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown `cancel_at` raises ValueError naming the valid phases, and
    nothing is started: no attempt is recorded, no admission or view refresh
    (no Ray call) happens. A deployment that was never launched would fail
    any such call, so reaching one would show up here as a different error."""
    deployment = actors.Deployment()
    calls: list[str] = []

    def forbid(name: str) -> object:
        async def called(*args: object, **kwargs: object) -> object:
            calls.append(name)
            raise AssertionError(f"{name} called for a refused cancel phase")

        return called

    names = ("_admit", "refresh_view", "send_opens", "cancel", "wait", "ranks")
    for name in names:
        assert hasattr(deployment, name), f"Deployment.{name} is gone: update this test"
        monkeypatch.setattr(deployment, name, forbid(name))
    with pytest.raises(actors.InvalidRequest, match="cancel_at must be one of") as info:
        asyncio.run(deployment.handoff("req-1", 16, cancel_at=phase))  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert repr(phase) in str(info.value)
    assert calls == []
    assert not deployment._recent  # no attempt was recorded
