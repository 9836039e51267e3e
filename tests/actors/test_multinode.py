"""Placement across nodes (docs/design.md "Placement") on a real multi-node Ray cluster.

`ray.cluster_utils.Cluster` runs a head and two worker raylets on this host:
the CTX node carries the custom resource `ctx_node`, the GEN node the label
`kvhandoff-role=gen`. Ranks on different raylets are different Ray nodes
(node ids, object stores, schedulers), so everything crossing them (agent
metadata through the directory, control frames, NIXL/UCX WRITEs, cancels,
drains) goes the way it goes between hosts, except that UCX still finds a
shared-memory path.

Each check reads where things really run (`get_node_id()` inside the rank
actors and coordinators), moves verified bytes, cancels at every phase and
ends with `assert_clean` (L2, S2, S4). The `kvhandoff demo --address` test
runs the CLI against a head it started with `ray start`, and stops only that
head (its own process group), never with `ray stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvhandoff.actors import Deployment, LaunchFailed, PlacementFailed
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.cli.harness import CANCEL_PHASES, handoff_cancel_at
from kvhandoff.protocol import Role

from .helpers import assert_clean, gen_bytes, inside, settled_stats

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

POOL = 24
TOKENS = 100  # 7 blocks of 16 tokens
TIMEOUT = 30.0
ROUND_TIMEOUT = 20.0  # a loaded 2-core box must not trip the watchdog
CTX_RESOURCES = {"ctx_node": 0.01}
GEN_LABELS = {"kvhandoff-role": "gen"}
UNPLACED_TIMEOUT_S = 5.0


# -- kvhandoff demo --address ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_head(proc: subprocess.Popen) -> None:
    """Stop the head this test started and nothing else: SIGTERM to `ray start
    --block` (it stops its raylet, GCS and workers), then SIGKILL to whatever
    of its process group is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group is ours alone
    proc.wait(timeout=10)


def test_demo_joins_an_existing_cluster_with_address(tmp_path: Path) -> None:
    """`kvhandoff demo --address` runs on a cluster started with `ray start
    --head` (token authentication on, as Ray starts it) instead of a local
    one, and leaves no placement group on it."""
    temp_dir = Path(tempfile.mkdtemp(prefix="kvh", dir="/tmp"))  # short: Ray's socket paths
    port = _free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),  # this head's own token, not ~/.ray's
        "NIXL_LOG_LEVEL": "WARN",
    }
    env.pop("RAY_ADDRESS", None)
    ray_bin = Path(sys.executable).parent / "ray"
    log = tmp_path / "head.log"
    with open(log, "wb") as out:
        head = subprocess.Popen(
            [
                str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                "--include-dashboard=false", f"--dashboard-port={_free_port()}",
                f"--temp-dir={temp_dir}", "--disable-usage-stats",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while b"Ray runtime started" not in log.read_bytes():
            assert head.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        address = f"127.0.0.1:{port}"
        demo = subprocess.run(
            [str(Path(sys.executable).parent / "kvhandoff"), "demo", "--address", address, "--requests", "10", "--pool-blocks", "128", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert demo.returncode == 0, demo.stderr[-3000:]
        report = json.loads(demo.stdout)
        assert report["ok"] and report["invariant_violations"] == [], report["invariant_violations"]
        assert report["requests"] == 10
        assert report["completed"] >= 1 and report["bytes_verified"] > 0
        assert report["leaked_blocks"] == 0 and report["quarantined_blocks"] == 0
        assert report["failed"] == 0 and report["timeout"] == 0
        # The demo ran on that cluster (not a local one), and left no placement group on it.
        probe = subprocess.run(
            [
                sys.executable, "-c",
                f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
                "t = ray.util.placement_group_table(); "
                "print(json.dumps([sorted(n['NodeID'] for n in ray.nodes()), "
                "sorted((g['name'], g['state']) for g in t.values())]))",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert probe.returncode == 0, probe.stderr[-3000:]
        cluster_nodes, groups = json.loads(probe.stdout.strip().splitlines()[-1])
        assert set(report["config"]["nodes"]) == {"ctx", "gen"}
        assert set(report["config"]["nodes"].values()) <= set(cluster_nodes), (report["config"], cluster_nodes)
        # Removed groups of a finished job may already be forgotten: none may be live.
        assert all(state == "REMOVED" for _, state in groups), groups
    finally:
        _stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


# -- a cluster of three nodes ---------------------------------------------------------------


@dataclass(frozen=True)
class Nodes:
    head: str
    ctx: str
    gen: str


@pytest.fixture(scope="module")
def nodes():
    """A head and two worker nodes, one per instance, on this host; shut down
    (every raylet of it) when the module ends, so later modules start their own."""
    from ray.cluster_utils import Cluster

    # A Ray left running by an earlier module (its fixture found one already
    # up and kept it) would be joined instead of this cluster.
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True, connect=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        ctx = cluster.add_node(num_cpus=1, resources={"ctx_node": 1})
        gen = cluster.add_node(num_cpus=1, labels=dict(GEN_LABELS))
        cluster.wait_for_nodes()
        yield Nodes(head=cluster.head_node.node_id, ctx=ctx.node_id, gen=gen.node_id)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_id(_: object) -> str:
    """Runs inside an actor: the node it runs on."""
    return ray.get_runtime_context().get_node_id()


async def _rank_nodes(dep: Deployment, role: Role) -> list[str]:
    return [await inside(h, _node_id) for h in await dep.ranks(role)]


def _group_states(name: str) -> dict[str, str]:
    """State of every placement group of deployment `name`, by group name."""
    table = ray.util.placement_group_table()
    return {g["name"]: g["state"] for g in table.values() if g["name"].startswith(f"{name}.")}


def test_instances_run_on_their_nodes_and_hand_off_across_them(nodes: Nodes) -> None:
    """CTX tp=2 on the `ctx_node` node (custom resource), GEN tp=1 on the
    `kvhandoff-role=gen` node (label), spread: every rank and each coordinator
    runs there; handoffs move verified bytes between the nodes, cancels at
    every phase end cleanly, and shutdown removes both placement groups."""

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2,
            gen_tp=1,
            placement="spread",
            ctx_resources=CTX_RESOURCES,
            gen_labels=GEN_LABELS,
            pool_blocks=4 * POOL,  # room for the concurrent batch: none of it is refused for blocks
            chunk_bytes=64 << 10,
            # Every chunk stays in flight a while: the mid-DMA cancel meets real DMA.
            fault_plan=FaultPlan(defer_s=0.2),
            transfer_timeout_s=5.0,
            round_timeout_s=ROUND_TIMEOUT,
            name="kvh-multinode",
        )
        try:
            where = {role: await _rank_nodes(dep, role) for role in (Role.CTX, Role.GEN)}
            coords = {role: await dep.coordinator(role).__ray_call__.remote(_node_id) for role in (Role.CTX, Role.GEN)}
            groups = _group_states(dep.name)
            phases = {}
            for phase in CANCEL_PHASES:
                phases[phase] = await handoff_cancel_at(dep, f"mn-{phase}", TOKENS, phase, timeout=TIMEOUT)
            # A concurrent batch, half of it cancelled while in flight.
            batch = [asyncio.ensure_future(dep.handoff(f"mn-batch-{i}", TOKENS + 16 * i, timeout=TIMEOUT)) for i in range(6)]
            await asyncio.gather(*(dep.cancel(f"mn-batch-{i}") for i in range(0, 6, 2)))
            batch_results = await asyncio.gather(*batch)
            stats = await settled_stats(dep, timeout=TIMEOUT)
            return dep, where, coords, groups, phases, batch_results, stats
        finally:
            await dep.shutdown()

    dep, where, coords, groups, phases, batch_results, stats = asyncio.run(scenario())
    assert dep.nodes == {Role.CTX: nodes.ctx, Role.GEN: nodes.gen}
    assert where == {Role.CTX: [nodes.ctx, nodes.ctx], Role.GEN: [nodes.gen]}
    assert coords == {Role.CTX: nodes.ctx, Role.GEN: nodes.gen}
    assert groups == {"kvh-multinode.ctx": "CREATED", "kvh-multinode.gen": "CREATED"}
    for phase in (None, "after_complete"):
        assert phases[phase].outcome == "completed", phases[phase]
        assert phases[phase].bytes_verified == gen_bytes(TOKENS, 1)
    for phase in ("before_open", "before_ready", "mid_dma"):
        assert phases[phase].outcome == "cancelled", (phase, phases[phase])
        assert phases[phase].bytes_verified == 0
    for i, r in enumerate(batch_results):
        assert r.outcome in ("completed", "cancelled"), r
        if r.outcome == "completed":
            assert r.bytes_verified == gen_bytes(TOKENS + 16 * i, 1)
    assert any(r.outcome == "completed" for r in batch_results[1::2])
    assert_clean(stats)
    ctx_posted = sum(s["posted_chunks"] for s in stats["ranks"] if s["role"] == "ctx")
    assert ctx_posted > 0  # the bytes crossed nodes over NIXL
    # No leak: shutdown removed both groups.
    assert _group_states("kvh-multinode") == {"kvh-multinode.ctx": "REMOVED", "kvh-multinode.gen": "REMOVED"}


def test_pack_puts_gen_on_the_ctx_node(nodes: Nodes) -> None:
    """"pack": GEN asks for no node of its own, yet lands where CTX did
    (pinned to its node id), among three nodes."""

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=1, gen_tp=1, placement="pack", ctx_resources=CTX_RESOURCES,
            pool_blocks=POOL, round_timeout_s=ROUND_TIMEOUT, name="kvh-pack",
        )
        try:
            where = {role: await _rank_nodes(dep, role) for role in (Role.CTX, Role.GEN)}
            result = await dep.handoff("pack-1", TOKENS, timeout=TIMEOUT)
            return dep, where, result, await settled_stats(dep, timeout=TIMEOUT)
        finally:
            await dep.shutdown()

    dep, where, result, stats = asyncio.run(scenario())
    assert dep.nodes == {Role.CTX: nodes.ctx, Role.GEN: nodes.ctx}
    assert where == {Role.CTX: [nodes.ctx], Role.GEN: [nodes.ctx]}
    assert result.outcome == "completed" and result.bytes_verified == gen_bytes(TOKENS, 1), result
    assert_clean(stats)
    assert set(_group_states("kvh-pack").values()) == {"REMOVED"}


@pytest.mark.parametrize(
    ("case", "kwargs", "says"),
    [
        # Both instances need the one `ctx_node` node, but "spread" keeps GEN off it.
        (
            "spread",
            {"placement": "spread", "ctx_resources": CTX_RESOURCES, "gen_resources": CTX_RESOURCES},
            "lacks ctx_node",
        ),
        ("labels", {"gen_labels": {"kvhandoff-role": "nowhere"}}, "no alive node matches the label selector"),
    ],
)
def test_unplaceable_instance_raises_in_time_and_leaves_no_group(nodes: Nodes, case: str, kwargs: dict, says: str) -> None:
    name = f"kvh-unplaced-{case}"

    async def scenario():
        return await Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, placement_timeout_s=UNPLACED_TIMEOUT_S, name=name, **kwargs
        )

    start = time.monotonic()
    with pytest.raises(PlacementFailed) as info:
        asyncio.run(scenario())
    elapsed = time.monotonic() - start
    err = info.value
    assert isinstance(err, LaunchFailed)
    assert err.role == "gen" and err.timeout_s == UNPLACED_TIMEOUT_S
    assert any(says in line for line in err.missing), err.missing
    assert says in str(err)
    assert elapsed < UNPLACED_TIMEOUT_S + 15.0, elapsed  # the bound, not a hang
    # The CTX group was placed, then removed with the GEN one; no actor was started.
    assert set(_group_states(name).values()) <= {"REMOVED"}, _group_states(name)
    assert _group_states(name), "the groups should have been asked for"
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if isinstance(a, dict)}
    assert not any(n.startswith(name) for n in named), named
