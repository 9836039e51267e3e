"""The actors layer's public surface (DESIGN.md "Public contract")."""

import inspect

import kvhandoff.actors as actors


def test_public_names_exist() -> None:
    for name in actors.__all__:
        assert hasattr(actors, name), name
    for name in ("launch", "launch_sync", "handoff", "cancel", "stats", "shutdown"):
        assert callable(getattr(actors.Deployment, name)), name


def test_handoff_cancel_phases_are_documented_and_checked() -> None:
    params = inspect.signature(actors.Deployment.handoff).parameters
    assert "cancel_at" in params
    assert set(actors.CANCEL_PHASES) == {None, "before_open", "before_ready", "mid_dma", "after_complete"}
