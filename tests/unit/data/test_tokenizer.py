"""The tiny tokenizer: Qwen's tool-call markers are one token each, added after the BPE vocabulary so every other
id is what it was without them, and the chat template names the tools a prompt may call."""

from __future__ import annotations

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from megatron_rl.data.datasets import Prompt
from megatron_rl.data.tokenizer import TOOL_TOKENS, build_tokenizer
from megatron_rl.rollout.session import PromptEncoder


def test_tool_markers_are_single_tokens_after_an_unchanged_vocabulary(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    ids = [tokenizer.convert_tokens_to_ids(marker) for marker in TOOL_TOKENS]
    assert ids == list(range(len(tokenizer) - len(TOOL_TOKENS), len(tokenizer)))
    text = '<tool_call>\n{"name": "python"}\n</tool_call>'
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert encoded[0] == ids[0] and encoded[-1] == ids[1] and tokenizer.decode(encoded) == text
    # The trained vocabulary holds ids 0..N-1 without gaps, the markers N..N+3: adding them moved no other id.
    trained = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).get_vocab(with_added_tokens=False)
    assert sorted(trained.values()) == list(range(len(tokenizer) - len(TOOL_TOKENS)))


def test_the_chat_template_names_a_prompts_tools_and_only_when_it_has_some(tmp_path):
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok")))
    plain = Prompt("a", "math", "What is 4 + 5?", "9")
    with_tools = Prompt("a", "math", "What is 4 + 5?", "9", tools=("python",))
    assert encoder.tokenizer.decode(encoder.encode(plain)) == (
        "<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert encoder.tokenizer.decode(encoder.encode(with_tools)) == (
        "<|im_start|>system\ntools: python<|im_end|>\n<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
