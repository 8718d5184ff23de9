"""tokcap adapter for Hugging Face TRL (skeleton; filled in by issue #34)."""

__all__: list[str] = []
