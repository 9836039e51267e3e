"""`kvhandoff bench --plot DIR`: PNG plots of one bench report (the dict that
`--json` prints), drawn with matplotlib's Agg backend (no display needed).

- bandwidth.png: GB/s against handoff size (data section) and against piece
  size (paged section), the raw-NIXL and plain-copy ceilings drawn dashed;
- latency_cdf.png: the small-handoff latency CDF, per sustained concurrency,
  and the cancel-to-release CDF;
- pool_occupancy.png: free / leased / quarantined blocks per role over the
  run (sampled during the control and cancel sections).

A plot whose section did not run is not written. matplotlib is imported
here only (`pip install 'kvhandoff[examples]'` brings it)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

__all__ = ["write_plots", "missing"]


def missing() -> str | None:
    """Why plots cannot be drawn here (matplotlib not installed), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'kvhandoff[examples]' (or matplotlib)"
    return None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _best(row: dict[str, Any], key: str) -> float | None:
    v = (row.get(key) or {}).get("best_gbps")
    return float(v) if isinstance(v, int | float) else None


def _series(ax: Any, xs: Sequence[float], rows: Sequence[dict[str, Any]], key: str, **style: Any) -> None:
    pts = [(x, _best(r, key)) for x, r in zip(xs, rows)]
    pts = [(x, y) for x, y in pts if y is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)


def _bandwidth(plt: Any, out: dict[str, Any], path: pathlib.Path) -> bool:
    data, paged = out.get("data") or [], out.get("paged") or []
    panels = [p for p in (("data", data), ("paged", paged)) if p[1]]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels):
        if name == "data":
            xs = [r["size_mib"] for r in rows]
            _series(ax, xs, rows, "e2e", marker="o", label="kvhandoff handoff (e2e)")
            _series(ax, xs, rows, "data", marker="o", label="kvhandoff data phase")
            _series(ax, xs, rows, "raw", linestyle="--", color="black", label="raw NIXL (ceiling)")
            _series(ax, xs, rows, "copy", linestyle=":", color="gray", label="plain copy (ceiling)")
            ax.set_xlabel("handoff size (MiB)")
            ax.set_title("handoff bandwidth")
        else:
            xs = [r.get("block_kib") or r.get("piece_kib") or 0 for r in rows]
            _series(ax, xs, rows, "direct", marker="o", label="kvhandoff direct")
            _series(ax, xs, rows, "staged", marker="o", label="kvhandoff staged")
            _series(ax, xs, rows, "raw", linestyle="--", color="black", label="raw NIXL, per piece (ceiling)")
            _series(ax, xs, rows, "contiguous", linestyle="-.", color="tab:purple", label="one contiguous WRITE")
            _series(ax, xs, rows, "copy", linestyle=":", color="gray", label="plain copy (ceiling)")
            ax.set_xlabel("piece size (KiB)")
            ax.set_title("paged KV: bandwidth per piece size")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (best)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values if isinstance(v, int | float))
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post", label=f"{label} (n={len(xs)})")


def _latency(plt: Any, out: dict[str, Any], path: pathlib.Path) -> bool:
    control, cancel = out.get("control") or {}, out.get("cancel") or {}
    small = (control.get("latency") or {}).get("samples_s") or []
    release = (cancel.get("release_s") or {}).get("samples") or []
    if not small and not release:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    ax = axes[0]
    _cdf(ax, small, "sequential")
    for s in control.get("sustained") or []:
        _cdf(ax, s.get("latency_samples_s") or [], f"{s['concurrency']} concurrent")
    ax.set_title(f"small-handoff latency ({control.get('small_tokens', '?')} tokens)")
    ax = axes[1]
    _cdf(ax, release, "cancel -> handoff returned")
    ax.set_title("cancel to release")
    for ax in axes:
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _pools(plt: Any, out: dict[str, Any], path: pathlib.Path) -> bool:
    samples = out.get("pools") or []
    if not samples:
        return False
    sections: dict[str, list[dict[str, Any]]] = {}
    for s in samples:  # each section runs on its own deployment (its own pools)
        sections.setdefault(s["section"], []).append(s)
    fig, axes = plt.subplots(1, len(sections), figsize=(6.5 * len(sections), 4.2), squeeze=False, sharey=True)
    for ax, (name, rows) in zip(axes[0], sections.items()):
        t0 = rows[0]["t"]
        ts = [r["t"] - t0 for r in rows]
        for role, style in (("ctx", "-"), ("gen", "--")):
            pool = [max(1, sum(r.get(f"{role}_{k}", 0) for k in ("free", "leased", "quarantined"))) for r in rows]
            for key, color in (("leased", "tab:blue"), ("quarantined", "tab:red")):
                ax.plot(ts, [100.0 * r.get(f"{role}_{key}", 0) / n for r, n in zip(rows, pool)],
                        style, color=color, marker=".", label=f"{role.upper()} {key} ({pool[0]} blocks)")
        ax.set_title(f"{name} section")
        ax.set_xlabel("seconds into the section")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("% of the pool (free = the rest)")
    fig.suptitle("block pools over time, summed per role")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(out: dict[str, Any], directory: str | pathlib.Path) -> list[pathlib.Path]:
    """Write the plots of `out` into `directory` (created); the paths written."""
    plt = _pyplot()
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("bandwidth.png", _bandwidth), ("latency_cdf.png", _latency), ("pool_occupancy.png", _pools)):
        if draw(plt, out, d / name):
            written.append(d / name)
    return written
