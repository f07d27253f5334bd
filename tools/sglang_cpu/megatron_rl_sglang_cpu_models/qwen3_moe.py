"""SGLang's qwen3_moe entry classes."""

from sglang.srt.models.qwen3_moe import EntryClass

__all__ = ["EntryClass"]
