"""kvhandoff: cancellation-safe KV-cache handoff for disaggregated LLM serving.

Layers (imports point downward only): `kvhandoff.actors` → `kvhandoff.topology`
→ `kvhandoff.protocol`. See docs/design.md for the design and its invariants.
"""

__version__ = "0.1.0"
