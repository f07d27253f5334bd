"""SGLang's qwen3 entry classes."""

from sglang.srt.models.qwen3 import EntryClass

__all__ = ["EntryClass"]
