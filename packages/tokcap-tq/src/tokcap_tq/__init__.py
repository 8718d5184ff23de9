"""tokcap adapter for TransferQueue (placeholder; the real modules land later)."""

__all__: list[str] = []
