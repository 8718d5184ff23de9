"""Message and output fingerprints: how the gate recognises a harness's echoed history, and
the content witness a scorer may send at close (`output_fingerprint`)."""

from ._admission import message_fingerprints, normalize_message, output_fingerprint

__all__ = ["message_fingerprints", "normalize_message", "output_fingerprint"]
