"""Integrations of kvhandoff with serving engines (optional extras)."""
