"""A small byte-level BPE tokenizer with a chat template, trained offline for tests and the CPU run.

Nothing is downloaded: the tokenizer is trained with `tokenizers` on text this module generates (the
synthetic tasks' prompts and answers, the interruption phrase, chat markers), so it covers what the
CPU run generates in few tokens. Digits are split one per token so arithmetic is learnable. The saved
directory loads with `transformers.AutoTokenizer` and SGLang alike.

`load_tokenizer(path)` loads any policy's tokenizer (this one or a Hub model's) in a process that computes
no tensors, the run's driver, without importing torch.
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path
from typing import Any

from megatron_rl.config import InterruptionConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""The tool-call markers of Qwen's and Hermes' chat templates (rollout/tools.py), one token each as in those
vocabularies: added after the BPE vocabulary, so they take the last ids and leave every other id as it was."""
PAD, EOS = "<|endoftext|>", "<|im_end|>"
REVISION = 2
"""Changes when what `build_tokenizer` writes changes (2: the tool tokens): cached tiny models are keyed on it."""

CHAT_TEMPLATE = (
    # the tools a prompt may call, by name (Qwen's template lists their JSON schemas: too long for a tiny model)
    "{% if tools %}<|im_start|>system\ntools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    phrase = InterruptionConfig().phrase
    lines = [phrase] * 50 + ["<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<|im_start|>system\n"] * 50
    words = [
        "What",
        "is",
        "the",
        "sum",
        "of",
        "and",
        "answer",
        "final",
        "think",
        "step",
        "carry",
        "so",
        "result",
        "Let",
        "me",
        "compute",
        "add",
        "numbers",
    ]
    for _ in range(2000):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        lines.append(f"What is {a} + {b}? {a}+{b}={a + b} \\boxed{{{a + b}}}")
        lines.append(" ".join(rng.choices(words, k=8)))
    lines.append("def solve(): return print(input()) for in range if else while")
    return lines


def _no_torch_advice(record: logging.LogRecord) -> bool:
    """Drops transformers' "PyTorch was not found" advice: torch is hidden on purpose, and a run's trainer has it."""
    return not str(record.msg).startswith("PyTorch was not found")


def load_tokenizer(path: str | Path) -> Any:
    """`transformers.AutoTokenizer.from_pretrained(path)`, without torch where nothing has imported it yet.

    transformers imports torch whenever torch is installed (~150 MB of a process's own memory and ~1 s of
    start-up), though a fast tokenizer and its chat template need only `tokenizers` and jinja2. In a process
    that has not imported torch (the run's driver: it sends token ids and never computes tensors),
    transformers is therefore imported with torch hidden: a `None` in `sys.modules` makes
    `importlib.util.find_spec("torch")` report it absent, transformers settles into its tokenizers-only mode
    (it decides once, at import), and torch is visible again when the import returns. The tokenizer is the
    same either way: the fast tokenizer is `tokenizers`' own, and token ids come back as lists
    (tests/integration/data/test_tokenizer_no_torch.py compares ids and chat templates with a torch process's).
    transformers' advice at that import ("PyTorch was not found. Models won't be available ...") is filtered
    from its logger for the import's duration: torch is hidden on purpose and would mislead a run's console.
    A process that already holds torch or transformers (the first CPU run, whose warm-up trains in the
    driver; the tests) loads it as it is."""
    if "torch" not in sys.modules and "transformers" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        advice = logging.getLogger("transformers")  # the logger transformers' import-time advice goes to
        advice.addFilter(_no_torch_advice)
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401  (decides at import)
        finally:
            del sys.modules["torch"]
            advice.removeFilter(_no_torch_advice)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, model_max_length: int = 1024) -> Path:
    """Train and save the tokenizer to `out_dir` (tokenizer.json + HF tokenizer files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    reserved = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    if vocab_size < 256 + reserved + 16:
        raise ValueError(
            f"model.vocab_size: a byte-level tokenizer needs >= {256 + reserved + 16} tokens, got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens(TOOL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=None,
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir
