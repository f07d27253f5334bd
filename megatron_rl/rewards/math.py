"""Math reward: the final answer after the thinking part, checked against the reference with Math-Verify.

    "<think>...</think> so the answer is \\boxed{82}"  vs  "82"   ->  correct

The thinking part is stripped first (everything up to the last `</think>`); a completion that opened
`<think>` and never closed it has no answer and is wrong. Math-Verify parses LaTeX (boxed answers first)
and plain expressions, and compares symbolically. Its timeouts use SIGALRM, which works only in a
process's main thread: call `math_reward` from a process (rewards/workers.py), not from a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import RewardsConfig


@dataclass
class RewardResult:
    reward: float
    passed: bool
    failure: str | None = None
    """Why it failed: 'no_answer', 'wrong_answer', 'timeout', 'reward_error', or a code failure."""


def answer_part(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> str | None:
    """The text after the thinking part; None if thinking was opened and never closed."""
    if close_tag in text:
        return text.rsplit(close_tag, 1)[1]
    if open_tag in text:
        return None
    return text


def math_reward(completion: str, answer: str, cfg: RewardsConfig) -> RewardResult:
    from math_verify import parse, verify

    final = answer_part(completion)
    if final is None or not final.strip():
        return RewardResult(cfg.incorrect, False, "no_answer")
    timeout = max(1, int(cfg.math_timeout_s))
    # A bare reference like "(x+1)^2" does not parse on its own; boxed, every form does.
    gold = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    predicted = parse(final, parsing_timeout=timeout)
    if not predicted:
        return RewardResult(cfg.incorrect, False, "no_answer")
    if verify(gold, predicted, timeout_seconds=timeout):
        return RewardResult(cfg.correct, True)
    return RewardResult(cfg.incorrect, False, "wrong_answer")
