"""tokcap adapter for Ray (placeholder; the real modules land later)."""

__all__: list[str] = []
