"""The warm-up cache: one policy per set of inputs, side by side, written atomically, reused when complete."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from safetensors.torch import load_file

from megatron_rl.config import ModelConfig, build, load_model_dict
from megatron_rl.data.datasets import Prompt
from megatron_rl.data.synthetic import arithmetic_rows, arithmetic_solution
from megatron_rl.models.tiny import build_tiny_model
from megatron_rl.orchestration import warmstart
from megatron_rl.orchestration.warmstart import WarmupTask, warm_start


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(str(r["id"]), "math", str(r["prompt"]), str(r["answer"])) for r in arithmetic_rows(0)[:n]]


def test_each_data_split_keeps_its_own_warm_policy_and_a_complete_one_is_reused(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", build(ModelConfig, load_model_dict("cpu_demo")), seed=3)
    out = tmp_path / "cache" / "warm"

    def run(prompts: int) -> Path:
        return warm_start(base, out, [WarmupTask(_prompts(prompts), arithmetic_solution)], steps=2, batch_size=4)

    small, large = run(40), run(60)  # e.g. two runs whose val_prompts differ: different training splits
    assert small != large and small.parent == large.parent == out.parent
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([small.name, large.name])  # no staging left
    for path in (small, large):
        assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
        assert json.loads((path / "warm_start.json").read_text())["steps"] == 2

    weights = (small / "model.safetensors").stat().st_mtime_ns
    assert run(40) == small and (small / "model.safetensors").stat().st_mtime_ns == weights  # reused, not rebuilt

    # A policy directory without its marker (a write interrupted before staging existed) is rebuilt.
    (small / "warm_start.json").unlink()
    (small / "model.safetensors").write_bytes(b"torn")
    assert run(40) == small
    assert load_file(str(small / "model.safetensors"))  # a readable checkpoint again
    assert json.loads((small / "warm_start.json").read_text())["steps"] == 2


def test_the_base_model_is_built_once_aside_and_reused_never_rewritten(tmp_path):
    """Concurrent runs read it while another starts: it is built in a staging directory and renamed into place,
    and a complete one is reused as it is (a reader never sees it half-written)."""
    import threading

    from megatron_rl.config import load_config
    from megatron_rl.orchestration.warmstart import base_model

    run = load_config("scalerl-cpu")
    results: list = []
    builders = [threading.Thread(target=lambda: results.append(base_model(run, tmp_path))) for _ in range(2)]
    for thread in builders:
        thread.start()
    for thread in builders:
        thread.join()
    (path,) = set(results)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns, weights.stat().st_ino
    assert base_model(run, tmp_path) == path and (weights.stat().st_mtime_ns, weights.stat().st_ino) == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    other = load_config("scalerl-cpu", None, ["seed=7"])
    assert base_model(other, tmp_path) != path


def test_a_tool_solution_trains_the_call_and_the_answer_never_the_tools_output(tmp_path):
    """With `tool_share` 1 every solution calls the tool: the ids are the prompt as a run encodes it (the tool
    named), the call, the output as the trajectory injects it (tokenised alone) and the boxed answer; only the
    call and the answer are trained. A slip miscopies an operand, and the output and the answer follow it."""
    import random

    from transformers import AutoTokenizer

    from megatron_rl.config import ToolsConfig
    from megatron_rl.data.synthetic import arithmetic_program
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.orchestration.warmstart import encode_example, solution_segments
    from megatron_rl.rollout.session import PromptEncoder

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    encoder, tools = PromptEncoder(tokenizer), ToolsConfig(enabled=["python"])
    prompt = Prompt("add-48-75", "math", "What is 48 + 75?", "123", tools=("python",))
    task = WarmupTask([prompt], arithmetic_solution, program=arithmetic_program, tool_share=1.0)
    segments = solution_segments(task, prompt, 0.0, random.Random(0), tools, tokenizer.eos_token)
    ids, trained = encode_example(tokenizer, encoder, segments, prompt)

    head = encoder.encode(prompt)
    call = tokenizer.encode(
        '<think><tool_call>\n{"name": "python", "arguments": {"code": "print(48 + 75)"}}\n</tool_call>'
    )
    output = tokenizer.encode("\n<tool_response>\n123\n</tool_response>\n", add_special_tokens=False)
    answer = tokenizer.encode("</think>\\boxed{123}<|im_end|>", add_special_tokens=False)
    assert ids == head + call + output + answer
    assert trained == [False] * len(head) + [True] * len(call) + [False] * len(output) + [True] * len(answer)
    assert "tools: python" in tokenizer.decode(head)

    # share 0: the worked solution by hand, trained whole, and no draw from the generator spent on the choice
    rng, by_hand = random.Random(0), WarmupTask([prompt], arithmetic_solution, program=arithmetic_program)
    ((text, learn),) = solution_segments(by_hand, prompt, 0.0, rng, tools, tokenizer.eos_token)
    assert (
        learn
        and text == arithmetic_solution(prompt.prompt) + "<|im_end|>"
        and rng.random() == random.Random(0).random()
    )

    slipped = {arithmetic_program("What is 48 + 75?", slip=0.999, rng=random.Random(seed)) for seed in range(20)}
    assert slipped == {("print(48 + 74)", "122"), ("print(48 + 76)", "124")}
    # the tool solutions' own slip (trainer.warm_start_tool_slip) overrides the warm-up's
    exact = WarmupTask([prompt], arithmetic_solution, program=arithmetic_program, tool_share=1.0, tool_slip=0.0)
    for seed in range(10):
        call, _, _ = solution_segments(exact, prompt, 0.999, random.Random(seed), tools, tokenizer.eos_token)
        assert "print(48 + 75)" in call[0]


def test_a_run_waits_for_a_concurrent_warm_up_of_the_same_inputs_and_reuses_it(tmp_path, monkeypatch, capsys):
    """Two runs started together (a sweep's) with the same inputs: the second waits for the first's warm-up and
    returns its policy, built once; no lock file is left in the cache."""
    base = build_tiny_model(tmp_path / "base", build(ModelConfig, load_model_dict("cpu_demo")), seed=3)
    out = tmp_path / "cache" / "warm"
    task = [WarmupTask(_prompts(40), arithmetic_solution)]
    built, release = [], threading.Event()
    build_here = warmstart._warm_start

    def slow_build(*args):
        built.append(args[1])
        release.wait(60)
        return build_here(*args)

    monkeypatch.setattr(warmstart, "_warm_start", slow_build)
    results: list[Path] = []
    runs = [threading.Thread(target=lambda: results.append(warm_start(base, out, task, steps=2, batch_size=4)))]
    runs[0].start()
    while not built:
        time.sleep(0.01)
    runs.append(threading.Thread(target=lambda: results.append(warm_start(base, out, task, steps=2, batch_size=4))))
    runs[1].start()
    deadline = time.monotonic() + 30
    while "waiting for another run's warm-up" not in capsys.readouterr().out:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release.set()
    for run in runs:
        run.join(60)
    assert len(built) == 1 and len(results) == 2 and results[0] == results[1]
    assert [p.name for p in out.parent.iterdir()] == [results[0].name]
