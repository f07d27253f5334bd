"""SGLang's llama entry classes."""

from sglang.srt.models.llama import EntryClass

__all__ = ["EntryClass"]
