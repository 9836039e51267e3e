"""Hop traces (actors/_trace.py) without Ray: which events make the critical
path, how hops are counted, and what a recorder keeps. The real actors'
traces are tested in tests/actors/test_client.py."""

from __future__ import annotations

import pytest

from kvhandoff.actors._trace import (
    MAX_EVENTS,
    MAX_REQUESTS,
    HandoffTrace,
    TraceEvent,
    TraceRecorder,
    critical_path,
    hop_summary,
    sampled,
)


def ev(t: int, actor: str, what: str, carrier: str, source: str = "") -> TraceEvent:
    return TraceEvent(t * 1_000_000, actor, what, carrier, source)


def timeline(*rows: str) -> list[TraceEvent]:
    """Events written as a table, one row each: "ms actor what carrier [source]"."""
    events = []
    for row in rows:
        t, *fields = row.split()
        events.append(ev(int(t), *fields))
    return events


def path_of(*rows: str) -> HandoffTrace:
    """The critical path of request "r" through the events of `rows` (see `timeline`)."""
    return critical_path("r", timeline(*rows))


def test_a_sequential_chain_is_all_hops() -> None:
    events = timeline(
        "0 client  submit      local",
        "1 coord@g submit      call  client",
        "3 rank0@g round_apply call  coord@g",
        "6 coord@g round_apply reply rank0@g",
        "7 client  outcome     reply coord@g",
    )
    trace = critical_path("r", list(reversed(events)))  # any order in
    assert [h.what for h in trace.path] == ["submit", "submit", "round_apply", "round_apply", "outcome"]
    assert trace.hops == 4 and trace.by_carrier == {"call": 2, "reply": 2}
    assert [h.since_prev_ms for h in trace.path] == [0.0, 1.0, 2.0, 3.0, 1.0]
    assert trace.total_ms == 7.0


def test_a_parallel_branch_is_not_a_hop() -> None:
    # The GEN rank's vote answered while the CTX instance admitted: the
    # coordinator waited for the CTX coordinator's answer, not for the vote.
    trace = path_of(
        " 0 client  submit     local",
        " 1 coord@g submit     call  client",
        " 2 coord@c admit_many call  coord@g",
        " 3 rank0@g round_vote call  coord@g",
        " 4 coord@g round_vote reply rank0@g",
        " 5 rank0@c round_vote call  coord@c",
        " 8 coord@c round_vote reply rank0@c",
        " 9 coord@g admit_many reply coord@c",
        "10 client  outcome    reply coord@g",
    )
    assert trace.hops == 6
    actors = [h.actor for h in trace.path]
    assert "rank0@g" not in actors


def test_the_known_sender_wins_over_a_later_bystander() -> None:
    # rank0@c got a frame (an off-path RECEIPT) after rank0@g answered:
    # the reply still came from rank0@g.
    events = timeline(
        "0 client  submit        local",
        "1 rank0@g round_apply   call  client",
        "2 rank0@c frame:Receipt call  rank0@g",
        "3 client  outcome       reply rank0@g",
    )
    trace = critical_path("r", events)
    assert [h.actor for h in trace.path] == ["client", "rank0@g", "client"]
    # Without the sender, the latest other actor is taken.
    anonymous = [*events[:3], ev(3, "client", "outcome", "reply")]
    assert [h.actor for h in critical_path("r", anonymous).path] == ["client", "rank0@g", "rank0@c", "client"]


def test_a_local_step_follows_its_own_actor() -> None:
    trace = path_of(
        "0 client  submit     local",
        "1 rank0@c frame:Open call",
        "2 client  retry      local",
    )
    assert [h.what for h in trace.path] == ["submit", "retry"]
    assert trace.hops == 0


def test_no_events_no_hops() -> None:
    trace = critical_path("r", [])
    assert (trace.hops, trace.path, trace.events) == (0, [], [])
    assert hop_summary([]) == {"n": 0}


def test_sampling_agrees_everywhere_and_is_off_by_default() -> None:
    ids = [f"req-{i}" for i in range(1000)]
    picked = [i for i in ids if sampled(i, 10)]
    assert 50 < len(picked) < 150  # about one in ten
    assert picked == [i for i in ids if sampled(i, 10)]  # a hash, not a coin: every actor agrees
    assert all(sampled(i, 1) for i in ids) and not any(sampled(i, 0) for i in ids)
    rec = TraceRecorder("rank0@x")
    rec.record("req-1", "round_vote", "call")
    assert rec.take("req-1") == [] and rec.stats()["requests"] == 0


def test_a_recorder_is_bounded_and_takes_once() -> None:
    rec = TraceRecorder("coord@x", every=1)
    for i in range(MAX_REQUESTS + 5):
        rec.record(f"r{i}", "submit", "call")
    assert rec.stats()["requests"] == MAX_REQUESTS and rec.dropped == 5
    assert rec.take("r0") == []  # the oldest went first
    for _ in range(MAX_EVENTS + 3):
        rec.record("big", "report", "call")
    assert len(rec.take("big")) == MAX_EVENTS and rec.take("big") == []
    rec.record_many(["a", "a", "b"], "round_apply", "call", "coord@x")
    assert [e.what for e in rec.take("a")] == ["round_apply"]  # once per request per message


@pytest.mark.parametrize("bad", [-1, 1.5, "1", None, True])
def test_bad_sampling_is_refused_and_changes_nothing(bad: object) -> None:
    rec = TraceRecorder("client", every=3)
    with pytest.raises(ValueError):
        rec.set_every(bad)  # type: ignore[arg-type]
    assert rec.every == 3


def test_summary_takes_the_common_path() -> None:
    def trace(extra: int) -> object:
        return critical_path("r", [
            ev(0, "client", "submit", "local"),
            ev(1 + extra, "coord@g", "submit", "call", "client"),
            ev(2 + extra, "client", "outcome", "reply", "coord@g"),
        ])

    summary = hop_summary([trace(0), trace(2), trace(4)])  # type: ignore[list-item]
    assert summary["hops_p50"] == 2 and summary["common_path"]["share"] == 1.0
    assert [s["p50_ms"] for s in summary["common_path"]["steps"]] == [0.0, 3.0, 1.0]
    assert summary["by_carrier_p50"] == {"call": 1.0, "reply": 1.0}


def test_the_path_ends_where_the_client_learned_the_outcome() -> None:
    # The coordinator answered at its decision; its rank applied afterwards.
    trace = path_of(
        "0 client  submit      local",
        "1 coord@g report      call  rank0@g",
        "2 client  outcome     reply coord@g",
        "3 rank0@g round_apply call  coord@g",
        "4 coord@g round_apply reply rank0@g",
    )
    assert [h.what for h in trace.path] == ["submit", "report", "outcome"]
    assert len(trace.events) == 5 and trace.total_ms == 2.0


def test_a_marked_send_is_the_cause_of_its_arrival() -> None:
    # The GEN coordinator sent admit_many, then its own rank's vote answered
    # before the CTX coordinator got the call: the vote is off the path.
    trace = path_of(
        "0 client  submit          local",
        "1 coord@g submit          call  client",
        "2 coord@g sent:admit_many local",
        "3 rank0@g round_vote      call  coord@g",
        "4 coord@g round_vote      reply rank0@g",
        "5 coord@c admit_many      call  coord@g",
        "6 coord@g admit_many      reply coord@c",
        "7 client  outcome         reply coord@g",
    )
    assert [h.what for h in trace.path] == ["submit", "submit", "sent:admit_many", "admit_many", "admit_many", "outcome"]
    assert trace.hops == 4


def test_events_after_a_take_are_not_kept() -> None:
    rec = TraceRecorder("coord@x", every=1)
    rec.record("r", "report", "call")
    assert len(rec.take("r")) == 1
    rec.record("r", "round_apply", "reply")  # the apply's answer, after the client heard
    assert rec.take("r") == [] and rec.stats()["requests"] == 0


def test_a_rank_that_answers_marks_its_answer_and_a_later_report_stays_off_the_path() -> None:
    # A receive at the GEN rank: the rank answers after the TERMINAL; its
    # lazy completion report and the coordinator's apply land before the
    # client records the outcome (a busy host). The answer's mark at the
    # rank keeps both off the path.
    trace = path_of(
        "0 client  submit         local",
        "1 rank0@g receive_alone  call   client",
        "2 rank0@c frame:Open     stream rank0@g",
        "3 rank0@g frame:Terminal stream rank0@c",
        "4 rank0@g sent:outcome   local",
        "5 coord@g report         call   rank0@g",
        "6 rank0@g round_apply    call   coord@g",
        "7 client  outcome        reply  rank0@g",
    )
    steps = [h.what for h in trace.path]
    assert steps == ["submit", "receive_alone", "frame:Open", "frame:Terminal", "sent:outcome", "outcome"], steps
    assert trace.hops == 4 and trace.by_carrier == {"call": 1, "stream": 2, "reply": 1}
