"""tokcap: compose tokcap-core with its TransferQueue, vLLM and Ray adapters."""

__all__: list[str] = []
