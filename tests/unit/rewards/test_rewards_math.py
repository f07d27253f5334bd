"""Math reward: thinking stripped, boxed and plain answers, failures counted, exceptions contained."""

import time

import math_verify.grader
import math_verify.parser
import pytest

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards import REWARDS, score
from megatron_rl.rewards import math as math_rewards
from megatron_rl.rewards.math import math_reward

CFG = RewardsConfig()


@pytest.fixture(autouse=True)
def _fresh_parses():
    """Parses are remembered per text: a test that makes Math-Verify hang must not get an earlier test's."""
    math_rewards._parse.cache_clear()


def test_a_repeated_text_is_parsed_once(monkeypatch):
    calls = []
    parse = math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda text, **kw: calls.append(text) or parse(text, **kw))
    results = [math_reward("</think>So: \\boxed{82}", "82", CFG) for _ in range(8)]
    assert all(r.passed for r in results) and sorted(calls) == ["So: \\boxed{82}", "\\boxed{82}"]  # answer, reference


@pytest.mark.parametrize(
    ("text", "answer", "passed", "failure"),
    [
        ("<think>7+5=12 3+4+1=8</think>\\boxed{82}", "82", True, None),
        ("<think>the answer is 81</think>\\boxed{82}", "82", True, None),  # thinking is not graded
        ("<think>the answer is 82</think>\\boxed{81}", "82", False, "wrong_answer"),
        ("<think>7+5=12 3+4", "82", False, "no_answer"),  # never closed thinking
        ("Okay, time is up. Let me stop thinking and formulate a final answer now. </think> 82", "82", True, None),
        ("</think>\\boxed{\\frac{1}{2}}", "0.5", True, None),
        ("</think>\\boxed{x^2+2x+1}", "(x+1)^2", True, None),
        ("</think>", "1", False, "no_answer"),
    ],
)
def test_math_reward(text, answer, passed, failure):
    result = math_reward(text, answer, CFG)
    assert (result.passed, result.failure) == (passed, failure)
    assert result.reward == (CFG.correct if passed else CFG.incorrect)


def test_rewards_are_configurable():
    result = math_reward("\\boxed{3}", "2", RewardsConfig(correct=1.0, incorrect=0.0))
    assert result.reward == 0.0


def test_a_raising_reward_function_is_a_counted_failure(monkeypatch):
    def broken(completion, prompt, cfg):
        raise RuntimeError("boom")

    monkeypatch.setitem(REWARDS, "math", broken)
    result = score("\\boxed{2}", Prompt("p", "math", "1+1?", "2"), CFG)
    assert (result.reward, result.passed, result.failure) == (CFG.incorrect, False, "reward_error")


def _stuck(*args, **kwargs):
    time.sleep(30)  # interrupted by Math-Verify's own SIGALRM timeout


def test_a_comparison_past_math_verify_timeout_is_a_timeout_not_a_wrong_answer(monkeypatch):
    # "4/2" matches "2" only symbolically (its string parse does not): that comparison hangs.
    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", _stuck)
    result = math_reward("</think>\\boxed{4/2}", "2", RewardsConfig(math_timeout_s=1))
    assert (result.reward, result.passed, result.failure) == (CFG.incorrect, False, "timeout")


def test_a_parse_past_math_verify_timeout_is_a_timeout_not_no_answer(monkeypatch):
    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred", _stuck)
    result = math_reward("</think>\\boxed{2}", "2", RewardsConfig(math_timeout_s=1))
    assert (result.reward, result.passed, result.failure) == (CFG.incorrect, False, "timeout")


def test_a_timed_out_comparison_does_not_hide_a_match(monkeypatch):
    # The string parses "2" and "2" match even though the symbolic comparison hangs.
    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", _stuck)
    result = math_reward("</think>\\boxed{2}", "2", RewardsConfig(math_timeout_s=1))
    assert (result.passed, result.failure) == (True, None)
