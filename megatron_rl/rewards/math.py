"""Math reward: the final answer after the thinking part, checked against the reference with Math-Verify.

    "<think>...</think> so the answer is \\boxed{82}"  vs  "82"   ->  correct

The thinking part is stripped first (everything up to the last `</think>`); a completion that opened
`<think>` and never closed it has no answer and is wrong. Math-Verify parses LaTeX (boxed answers first)
and plain expressions, and compares symbolically. Its timeouts use SIGALRM, which works only in a
process's main thread: call `math_reward` from a process (rewards/workers.py), not from a thread.

A parse or a comparison that runs past `cfg.math_timeout_s` is 'timeout', not 'wrong_answer': Math-Verify
itself turns its timeout into an empty parse or a failed comparison, so it is asked to raise instead
(`raise_on_error=True`) and its other errors are treated as it treats them by default (unparseable: no
answer; a comparison that fails: no match). A timed-out comparison is 'timeout' unless another pair of
parses matched.
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass
from typing import Any

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
    from math_verify.errors import TimeoutException

    if threading.current_thread() is not threading.main_thread():
        # Math-Verify's SIGALRM timeouts cannot work here; it would raise a ValueError we must not swallow.
        raise RuntimeError("math_reward runs only in a process's main thread (Math-Verify's timeouts use SIGALRM)")
    final = answer_part(completion)
    if final is None or not final.strip():
        return RewardResult(cfg.incorrect, False, "no_answer")
    timeout = _timeout(cfg)
    try:
        # A bare reference like "(x+1)^2" does not parse on its own; boxed, every form does.
        gold = _parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}", timeout)
        predicted = _parse(final, timeout)
    except TimeoutException:
        return RewardResult(cfg.incorrect, False, "timeout")
    if not predicted:
        return RewardResult(cfg.incorrect, False, "no_answer")
    matched = _verify(gold, predicted, timeout)
    if matched is None:
        return RewardResult(cfg.incorrect, False, "timeout")
    if matched:
        return RewardResult(cfg.correct, True)
    return RewardResult(cfg.incorrect, False, "wrong_answer")


def math_time_bound_s(cfg: RewardsConfig) -> float:
    """The longest `math_reward` takes without a hang: two parses and up to 2 x 2 comparisons, each bounded."""
    return 6.0 * _timeout(cfg)


def _timeout(cfg: RewardsConfig) -> int:
    return max(1, int(cfg.math_timeout_s))  # SIGALRM counts whole seconds


@functools.lru_cache(maxsize=4096)
def _parse(text: str, timeout: int) -> list[Any]:
    """Math-Verify's parses of `text` ([] if none); raises its TimeoutException past `timeout` seconds.

    Remembered per text (a timeout is not): a group's samples share their reference, and often their final
    answer, and the parse (LaTeX to SymPy) is most of a reward's CPU."""
    from math_verify import parse

    try:
        return parse(text, parsing_timeout=timeout, raise_on_error=True)
    except Exception:  # what parse does without raise_on_error: an unparseable text has no parse
        return []


def _verify(gold: list[Any], predicted: list[Any], timeout: int) -> bool | None:
    """Whether any pair of parses matches, as Math-Verify's `verify` on the lists; None if none matched
    and a comparison timed out."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timed_out = False
    for expected, got in itertools.product(gold, predicted):
        try:
            if verify(expected, got, timeout_seconds=timeout, raise_on_error=True):
                return True
        except TimeoutException:
            timed_out = True
        except Exception:  # what verify does without raise_on_error: a comparison that fails is no match
            continue
    return None if timed_out else False
