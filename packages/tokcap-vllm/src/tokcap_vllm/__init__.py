"""tokcap adapter for vLLM (placeholder; the real modules land later)."""

__all__: list[str] = []
