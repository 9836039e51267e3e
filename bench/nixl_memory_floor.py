"""NIXL's own floor for the soak: does an agent grow per transfer?

Two Ray actors, each with a raw NIXL agent (UCX, no progress thread, as the
ranks create theirs) over a host buffer of 16 KiB blocks. The writer posts
small WRITEs of 8 blocks back to back, each with a notification, polls each
to DONE and releases its handle; the target drains its notifications (which
also progresses its worker), as a GEN rank does. Two phases, one after the
other: WRITEs from prepared descriptor lists (`make_prepped_xfer`, what the
ranks use) and WRITEs from descriptors built per transfer
(`initialize_xfer`). Every 10 s both processes' settled resident bytes are
sampled (after `gc.collect()` and `malloc_trim(0)`, as `kvhandoff bench
--sections soak` does); per phase the least-squares slope over its last two
thirds is printed in bytes per transfer, as JSON on the last line.

    python bench/nixl_memory_floor.py [seconds per phase]     # default 60
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np
import ray
import torch

from kvhandoff.cli._bench_soak import settled_resident, slope

BLOCK = 16 * 1024
BLOCKS = 512
PER_WRITE = 8


@ray.remote(num_cpus=0)
class Agent:
    def __init__(self, name: str) -> None:
        from kvhandoff.actors._nixl import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.buffer = torch.zeros(BLOCKS * BLOCK, dtype=torch.uint8)
        self.registration = self.agent.register_memory([self.buffer])
        self.count = 0
        self.peer = ""

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def addr(self) -> int:
        return int(self.buffer.data_ptr())

    def add_peer(self, metadata: bytes) -> None:
        self.peer = self.agent.add_remote_agent(metadata)

    def rss(self) -> tuple[int, int | None]:
        return self.count, settled_resident()

    async def drain(self, seconds: float) -> int:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for messages in self.agent.get_new_notifs().values():
                self.count += len(messages)
            await asyncio.sleep(0.0005)
        return self.count

    def _descs(self, base: int, blocks: np.ndarray) -> np.ndarray:
        descs = np.empty((len(blocks), 3), dtype=np.uint64)
        descs[:, 0] = base + blocks.astype(np.uint64) * BLOCK
        descs[:, 1] = BLOCK
        descs[:, 2] = 0
        return descs

    async def write(self, mode: str, seconds: float, remote: int) -> int:
        every = np.arange(BLOCKS, dtype=np.uint64)
        if mode == "prepped":
            local_list = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._descs(self.addr(), every), "DRAM")
            remote_list = self.agent.prep_xfer_dlist(self.peer, self._descs(remote, every), "DRAM")
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            start = (i * PER_WRITE) % (BLOCKS - PER_WRITE)
            blocks = np.arange(start, start + PER_WRITE, dtype=np.uint64)
            if mode == "prepped":
                handle = self.agent.make_prepped_xfer(
                    "WRITE", local_list, blocks.astype(np.int64), remote_list, blocks.astype(np.int64), b"n"
                )
            else:
                local = self.agent.get_xfer_descs(self._descs(self.addr(), blocks), "DRAM")
                far = self.agent.get_xfer_descs(self._descs(remote, blocks), "DRAM")
                handle = self.agent.initialize_xfer("WRITE", local, far, self.peer, b"n")
            state = self.agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError("a WRITE failed")
                await asyncio.sleep(0)
                state = self.agent.check_xfer_state(handle)
            self.agent.release_xfer_handle(handle)
            i += 1
            self.count += 1
        if mode == "prepped":
            self.agent.release_dlist_handle(local_list)
            self.agent.release_dlist_handle(remote_list)
        return self.count


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    ray.init(num_cpus=2, include_dashboard=False)
    writer = Agent.remote("floor-writer")  # type: ignore[attr-defined]
    target = Agent.remote("floor-target")  # type: ignore[attr-defined]
    ray.get(writer.add_peer.remote(ray.get(target.metadata.remote())))
    ray.get(target.add_peer.remote(ray.get(writer.metadata.remote())))
    remote = ray.get(target.addr.remote())
    out: dict[str, Any] = {"seconds_per_phase": seconds, "blocks_per_write": PER_WRITE, "block_bytes": BLOCK}
    for mode in ("prepped", "initialize"):
        drained = target.drain.remote(seconds + 5)
        written = writer.write.remote(mode, seconds, remote)
        samples: list[tuple[int, int, int]] = []
        t0 = time.time()
        while True:
            done, _ = ray.wait([written], timeout=10)
            count, rss = ray.get(writer.rss.remote())
            _, target_rss = ray.get(target.rss.remote())
            samples.append((count, rss, target_rss))
            print(mode, round(time.time() - t0), count, rss, target_rss, flush=True)
            if done:
                break
        ray.get(written)
        ray.get(drained)
        tail = samples[len(samples) // 3 :]
        first = tail[0][0] if tail else 0
        out[mode] = {
            "writes": samples[-1][0] - samples[0][0] if samples else 0,
            "writer_bytes_per_write": slope([c - first for c, _, _ in tail], [r for _, r, _ in tail]),
            "target_bytes_per_write": slope([c - first for c, _, _ in tail], [r for _, _, r in tail]),
            "samples": samples,
        }
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "samples"} if isinstance(v, dict) else v) for k, v in out.items()}))
    ray.shutdown()


if __name__ == "__main__":
    main()
