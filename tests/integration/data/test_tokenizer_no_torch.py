"""The run's driver holds no torch: it loads the policy's tokenizer with transformers in its tokenizers-only mode
(`data.tokenizer.load_tokenizer`), and the modules it runs at every step import none.

The tokenizer such a process loads must be the one a torch process loads: same ids for text, the same chat
template rendering, the same special tokens. The reference here is this (torch-holding) test process's own
`AutoTokenizer`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from megatron_rl.config import InterruptionConfig
from megatron_rl.data.tokenizer import build_tokenizer

TEXTS = ["What is 123 + 45?", " \\boxed{168}", "Let me add the numbers: 3+5=8 carry 1", "<think>so</think> done"]
MESSAGES = [
    [{"role": "user", "content": "What is 1 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
]

PROBE = """
import json, sys
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.orchestration import engines, train  # noqa: F401  (the driver's step-time modules)
from megatron_rl.rollout import pipeline, evaluation  # noqa: F401
ids = lambda value: list(value["input_ids"] if hasattr(value, "keys") else value)
tok = load_tokenizer(sys.argv[1])
texts, messages, phrase = json.loads(sys.argv[2])
out = {
    "ids": [tok(t, add_special_tokens=False)["input_ids"] for t in texts],
    "chat": [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages],
    "chat_ids": [ids(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)) for m in messages],
    "decoded": [tok.decode(tok(t)["input_ids"]) for t in texts],
    "eos": tok.eos_token_id,
    "end": tok.convert_tokens_to_ids("</think>"),
    "phrase": tok(phrase, add_special_tokens=False)["input_ids"],
    "torch": "torch" in sys.modules,
    "filters": len(__import__("logging").getLogger("transformers").filters),
}
print(json.dumps(out))
"""


def _ids(value: object) -> list[int]:
    """`apply_chat_template(tokenize=True)` answers a list, or a BatchEncoding whose `input_ids` is the list."""
    return list(value["input_ids"] if hasattr(value, "keys") else value)  # type: ignore[index]


def test_the_driver_loads_the_same_tokenizer_without_torch(tmp_path: Path) -> None:
    path = build_tokenizer(tmp_path / "tok")
    phrase = " " + InterruptionConfig().phrase
    args = json.dumps([TEXTS, MESSAGES, phrase])
    result = subprocess.run([sys.executable, "-c", PROBE, str(path), args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["torch"] is False, "the driver's tokenizer or step-time modules imported torch"
    # torch is hidden on purpose: transformers' "PyTorch was not found" advice would mislead a run's console
    assert "PyTorch was not found" not in result.stderr + result.stdout, result.stderr
    assert got["filters"] == 0  # transformers' logger is left as it was

    ref = AutoTokenizer.from_pretrained(path)
    assert got["ids"] == [ref(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert got["chat"] == [ref.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in MESSAGES]
    want = [_ids(ref.apply_chat_template(m, add_generation_prompt=True, tokenize=True)) for m in MESSAGES]
    assert got["chat_ids"] == want
    assert got["decoded"] == [ref.decode(ref(t)["input_ids"]) for t in TEXTS]
    assert (got["eos"], got["end"]) == (ref.eos_token_id, ref.convert_tokens_to_ids("</think>"))
    assert got["phrase"] == ref(phrase, add_special_tokens=False)["input_ids"]
    assert got["phrase"] and all(isinstance(i, int) for ids in got["ids"] for i in ids)


def test_a_process_holding_torch_keeps_transformers_as_it_is(tmp_path: Path) -> None:
    """Where torch is imported already (the first CPU run trains its warm-up in the driver), transformers keeps
    its torch features: the model classes still load."""
    path = build_tokenizer(tmp_path / "tok")
    code = (
        "import sys, torch; from megatron_rl.data.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]);"
        "from transformers.utils import is_torch_available; assert is_torch_available();"
        "from transformers import LlamaForCausalLM, LlamaConfig;"
        "LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,"
        " num_attention_heads=1, vocab_size=16))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
