"""VeriCache for LMCache + vLLM: lossy KV-cache compression made lossless by draft-and-verify."""

__version__ = "0.1.0"
