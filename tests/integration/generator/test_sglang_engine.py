"""A real SGLang server on CPU with a tiny Llama (model_configs/cpu_demo.yaml): generation, generator
log-probs against transformers, pause/continue, weight updates (distributed and from disk) with versions,
failures and retries.

One server serves the whole module (~2 GB RSS, 25-60 s to start on 2 cores). The tests run in file order
and the last one kills and restarts it.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
from pathlib import Path

import pytest
import torch

from megatron_rl.config import EngineConfig, ModelConfig, SamplingConfig, build, load_config, load_model_dict
from megatron_rl.generator.balancer import EngineBalancer
from megatron_rl.generator.client import EngineRequestError, EngineUnavailableError, SGLangClient, as_generate_fn
from megatron_rl.generator.server import SGLangServer
from megatron_rl.generator.weight_sync import WeightSender, make_buckets
from megatron_rl.ports import free_port
from megatron_rl.rollout.interruption import InterruptionTokens, Segment, generate_completion

pytestmark = pytest.mark.slow

ENGINE = EngineConfig(device="cpu", dtype="float32", tp=1, fp32_lm_head=True)
T1 = SamplingConfig(temperature=1.0, top_p=1.0)
FIXED = {"ignore_eos": True}  # fixed-length answers where a test needs a long running sequence
IN_FLIGHT_TOKENS = 480
PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [100, 200, 300, 400, 12], [33]]

# Generator log-probs vs an independent transformers forward on the same tokens (both fp32): measured
# mean |diff| ~1e-7 and max ~1e-6 on this model; the bounds leave an order of magnitude.
MEAN_BOUND, MAX_BOUND = 1e-5, 1e-4


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from megatron_rl.models.tiny import build_tiny_model

    cfg = build(ModelConfig, load_model_dict("cpu_demo"))
    return build_tiny_model(tmp_path_factory.mktemp("engine") / "model", cfg, seed=11)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eos(model_dir) -> int:
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(model_dir).eos_token_id)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = SGLangServer(model_dir, ENGINE, tmp_path_factory.mktemp("logs") / "engine.log", max_total_tokens=8192)
    srv.start()
    try:
        run(srv.wait_ready(timeout_s=400))
        print(f"\nSGLang server ready in {srv.ready_seconds:.1f} s")
        yield srv
    finally:
        srv.stop()


def hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(token_i | prompt, tokens_<i) of the sampling distribution, from one transformers forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[positions, torch.tensor(tokens)]


def logprob_error(model, prompt: list[int], segment: Segment, temperature: float = 1.0) -> tuple[float, float]:
    diff = (torch.tensor(segment.logprobs).double() - hf_logprobs(model, prompt, segment.tokens, temperature)).abs()
    return float(diff.mean()), float(diff.max())


def test_server_that_dies_at_start_reports_its_log_tail(tmp_path):
    log = tmp_path / "bad.log"
    bad = SGLangServer(tmp_path / "no-model-here", ENGINE, log)
    bad.start()
    with pytest.raises(EngineUnavailableError) as died:
        run(bad.wait_ready(timeout_s=300))
    assert "exited with code" in str(died.value) and str(log) in str(died.value)
    assert "no-model-here" in str(died.value)  # SGLang's own error, from the log tail
    assert not bad.alive() and bad.process is None


def test_readiness_and_health_probes_generate_nothing(server):
    """`wait_ready` and `health()` read the server's status: SGLang's generating `/health` sleeps a second before
    it looks for its token, which made every engine start ~1 s later than the server was up."""

    async def go():
        client = SGLangClient(server.url)
        try:
            return await client.health()
        finally:
            await client.close()

    assert run(go())
    assert "Prefill batch" not in server.log_path.read_text()  # the fixture's wait_ready and the probe: no request


def test_a_cpu_server_starts_without_an_error_in_its_log(server):
    """SGLang posts its post-warm-up `/freeze_gc` before its listener is up when the warm-up is skipped (the CPU
    engine's command): every start logged a ConnectionRefusedError traceback until the CPU shim skipped it."""
    log = server.log_path.read_text()
    assert "Application startup complete" in log
    assert "Traceback" not in log and "freeze_gc failed" not in log, log[-3000:]


def test_generate_returns_tokens_logprobs_versions_and_finish(server, eos):
    async def go():
        client = SGLangClient(server.url)
        try:
            short = await client.generate(PROMPTS[0], 24, [eos], T1)
            many = await asyncio.gather(*(client.generate([3, 4, i], 16, [eos], T1) for i in range(32)))
            empty = await client.generate(PROMPTS[0], 0, [eos], T1)
            return short, many, empty, client.outstanding
        finally:
            await client.close()

    short, many, empty, outstanding = run(go())
    for segment in [short, *many]:
        assert 1 <= len(segment.tokens) == len(segment.logprobs) == len(segment.versions)
        assert segment.finish in ("stop", "length")
        assert segment.versions == [0] * len(segment.tokens)  # the server starts at version 0
        assert all(-60.0 < lp <= 0.0 for lp in segment.logprobs)
        if segment.finish == "stop":  # the stop token is part of the segment
            assert segment.tokens[-1] == eos and eos not in segment.tokens[:-1]
        else:
            assert eos not in segment.tokens
    assert short.finish == "stop" or len(short.tokens) == 24
    assert empty == Segment([], [], [], "length")
    assert outstanding == 0


def test_generator_logprobs_match_transformers(server, hf_model):
    async def go(temperature):
        client = SGLangClient(server.url)
        sampling = SamplingConfig(temperature=temperature)
        try:
            return await asyncio.gather(*(client.generate(p, 32, [], sampling, FIXED) for p in PROMPTS))
        finally:
            await client.close()

    for temperature in (1.0, 0.7):
        segments = run(go(temperature))
        errors = [logprob_error(hf_model, p, s, temperature) for p, s in zip(PROMPTS, segments, strict=True)]
        mean = sum(e[0] for e in errors) / len(errors)
        worst = max(e[1] for e in errors)
        print(f"\nT={temperature}: generator vs transformers log-prob |diff| mean {mean:.2e}, max {worst:.2e}")
        assert all(len(s.tokens) == 32 for s in segments)
        assert mean < MEAN_BOUND and worst < MAX_BOUND
    # the comparison can fail: the same tokens scored at another temperature are far off
    assert logprob_error(hf_model, PROMPTS[0], segments[0], 1.0)[0] > 100 * MEAN_BOUND


def test_copies_of_a_prompt_in_one_turn_prefill_it_once(server, hf_model):
    """A group's G completions of one prompt: the client prefills the prompt once ahead of them, each completion
    finds it in SGLang's prefix cache (its own prefill: the last prompt token), and their log-probs are still
    transformers' on the same tokens."""
    prompt = [random.Random(5).randrange(3, 500) for _ in range(24)]
    start = server.log_path.stat().st_size

    async def go():
        client = SGLangClient(server.url)
        try:
            return await asyncio.gather(*(client.generate(prompt, 8, [], T1, FIXED) for _ in range(8)))
        finally:
            await client.close()

    segments = run(go())
    log = server.log_path.read_bytes()[start:].decode(errors="replace")
    prefilled = [int(n) for n in re.findall(r"#new-token: (\d+)", log)]
    assert sum(prefilled) == len(prompt) + 8, log[-2000:]  # without the prefill ahead: 8 x 24
    errors = [logprob_error(hf_model, prompt, segment) for segment in segments]
    assert all(len(segment.tokens) == 8 for segment in segments)
    assert max(e[1] for e in errors) < MAX_BOUND


def test_pause_in_place_keeps_running_sequences_and_continue_resumes(server):
    async def go():
        client = SGLangClient(server.url)
        try:
            running = asyncio.create_task(client.generate(PROMPTS[1], 300, [], T1, FIXED))
            await asyncio.sleep(0.5)
            await client.pause("in_place")
            queued = asyncio.create_task(client.generate(PROMPTS[0], 1, [], T1))
            await asyncio.sleep(1.5)
            held = (running.done(), queued.done())
            healthy_while_paused = await client.model_info()  # control requests still answer
            await client.resume()
            return held, healthy_while_paused, await running, await queued
        finally:
            await client.close()

    (running_done, queued_done), info, running, queued = run(go())
    assert not running_done and not queued_done  # nothing is generated while paused
    assert info["weight_version"] == "0"
    assert len(running.tokens) == 300 and running.finish == "length"
    assert len(queued.tokens) == 1


def test_pause_abort_ends_running_sequences_with_abort(server):
    async def go():
        client = SGLangClient(server.url)
        try:
            running = asyncio.create_task(client.generate(PROMPTS[2], 480, [], T1, FIXED))
            await asyncio.sleep(0.5)
            await client.pause("abort")
            aborted = await running
            await client.resume()
            after = await client.generate(PROMPTS[2], 4, [], T1, FIXED)
            return aborted, after
        finally:
            await client.close()

    aborted, after = run(go())
    assert aborted.finish == "abort" and len(aborted.tokens) < 480
    assert len(aborted.tokens) == len(aborted.logprobs) == len(aborted.versions)
    assert after.finish == "length" and len(after.tokens) == 4


def _perturbed(model_dir: Path, seed: int, scale: float) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(model_dir / "model.safetensors"))
    return {name: t + scale * torch.randn(t.shape, generator=gen) for name, t in sorted(weights.items())}


def _load(model, weights: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)


def test_distributed_update_in_flight_changes_weights_versions_and_logprobs(server, model_dir, hf_model):
    new = _perturbed(model_dir, seed=1, scale=0.05)
    sender = WeightSender([server.url], "127.0.0.1", free_port(), load_config("scalerl-cpu").rollout)

    async def go():
        client = SGLangClient(server.url)
        try:
            await asyncio.to_thread(sender.connect)
            # The sequence is running when the weights change: 480 tokens (the model's 512 positions allow no
            # more) take well over a second on this engine, and the push pauses it in place until it resumes.
            # A 1 s head start raced the sequence's end on a quiet machine; 0.3 s still lets it start.
            running = asyncio.create_task(client.generate(PROMPTS[1], IN_FLIGHT_TOKENS, [], T1, FIXED))
            await asyncio.sleep(0.3)
            buckets = make_buckets(new.items(), bucket_bytes=1 << 20)  # several buckets
            stats = await asyncio.to_thread(sender.send, buckets, 3)
            in_flight = await running
            # the prefix cache could not be dropped while the sequence ran (sync/cache_flushed 0); now it
            # can, so the requests below do not reuse prompt KV computed with the old weights
            flushed_when_idle = await client.flush_cache()
            version = await client.weight_version()
            values = {n: await client.get_weights_by_name(n, 1000) for n in ("model.norm.weight", "lm_head.weight")}
            after = await asyncio.gather(*(client.generate(p, 32, [], T1, FIXED) for p in PROMPTS))
            return stats, in_flight, flushed_when_idle, version, values, after
        finally:
            await client.close()

    try:
        stats, in_flight, flushed_when_idle, version, values, after = run(go())
    finally:
        sender.close()
    print(f"\ndistributed update: {stats}")
    assert stats["sync/bytes"] == sum(t.numel() * t.element_size() for t in new.values())
    assert stats["sync/buckets"] >= 3
    assert stats["sync/cache_flushed"] == 0.0 and flushed_when_idle
    assert version == 3
    assert torch.equal(torch.tensor(values["model.norm.weight"]).flatten(), new["model.norm.weight"])
    lm_head = torch.tensor(values["lm_head.weight"])
    assert torch.equal(lm_head, new["lm_head.weight"][: lm_head.shape[0]])
    # in flight: the running sequence's first tokens came from version 0, the rest from version 3
    versions = in_flight.versions
    assert len(versions) == IN_FLIGHT_TOKENS and versions[0] == 0 and versions[-1] == 3
    assert versions == sorted(versions) and set(versions) == {0, 3}
    assert all(v == 3 for s in after for v in s.versions)
    # the engine now samples from the new weights: its log-probs match transformers with those weights
    old_error = logprob_error(hf_model, PROMPTS[0], after[0])[0]
    _load(hf_model, new)
    errors = [logprob_error(hf_model, p, s) for p, s in zip(PROMPTS, after, strict=True)]
    assert max(e[1] for e in errors) < MAX_BOUND
    assert old_error > 100 * MEAN_BOUND


def test_update_from_disk(server, model_dir, hf_model):
    from safetensors.torch import load_file

    original = load_file(str(model_dir / "model.safetensors"))
    other = _perturbed(model_dir, seed=2, scale=0.05)
    disk_sender = WeightSender(
        [server.url], "127.0.0.1", 0, load_config("scalerl-cpu", None, ["rollout.weight_sync=disk"]).rollout
    )

    async def go():
        client = SGLangClient(server.url)
        try:
            stats = await asyncio.to_thread(disk_sender.send, [list(other.items())], 6)
            via_sender = (await client.weight_version(), await client.get_weights_by_name("model.norm.weight", 1000))
            await client.update_weights_from_disk(str(model_dir), version=7)  # a full HF directory
            restored = (await client.weight_version(), await client.get_weights_by_name("model.norm.weight", 1000))
            segment = await client.generate(PROMPTS[0], 32, [], T1, FIXED)
            with pytest.raises(EngineRequestError):
                await client.update_weights_from_disk(str(model_dir / "missing"), version=8)
            return stats, via_sender, restored, segment, await client.weight_version()
        finally:
            await client.close()

    try:
        stats, via_sender, restored, segment, final_version = run(go())
    finally:
        disk_sender.close()
    print(f"\ndisk update: {stats}")
    assert stats["sync/cache_flushed"] == 1.0  # an idle engine: the old prefixes are gone
    assert via_sender[0] == 6 and torch.equal(torch.tensor(via_sender[1]), other["model.norm.weight"])
    assert restored[0] == 7 and torch.equal(torch.tensor(restored[1]), original["model.norm.weight"])
    assert segment.versions == [7] * 32
    _load(hf_model, original)
    assert logprob_error(hf_model, PROMPTS[0], segment)[1] < MAX_BOUND
    assert final_version == 7  # a failed load leaves the version alone


def test_dead_engine_is_retried_on_another_and_counted(server):
    async def go():
        dead = SGLangClient(f"http://127.0.0.1:{free_port()}", connect_retries=1, retry_backoff_s=0.05)
        alive = SGLangClient(server.url)
        try:
            balancer = EngineBalancer([dead, alive], T1, max_retries=2)
            segments = [await balancer([3, 4, 5], 4, []) for _ in range(3)]
            stats = (balancer.failures, balancer.retries, list(balancer.failures_by_engine))
            with pytest.raises(EngineUnavailableError):
                await dead.generate([3], 2, [], T1)
            only_dead = EngineBalancer([dead], T1, max_retries=1)
            with pytest.raises(EngineUnavailableError):
                await only_dead([3], 2, [])
            # a request the engine rejects (prompt beyond the context length) is not retried elsewhere
            with pytest.raises(EngineRequestError) as rejected:
                await balancer([1] * 600, 4, [])
            return segments, stats, only_dead.failures, balancer.retries, rejected.value.status
        finally:
            await dead.close()
            await alive.close()

    segments, (failures, retries, by_engine), dead_failures, retries_after, status = run(go())
    assert all(len(s.tokens) == 4 or s.finish == "stop" for s in segments)
    # the first request tried the dead engine once; later ones avoid it while it is marked down
    assert failures == 1 and retries == 1 and by_engine == [1, 0]
    assert dead_failures == 2
    assert 400 <= status < 500 and retries_after == retries


def test_interruption_through_the_engine_is_injected_and_masked(server):
    """generate_completion (interruption.py) with the balancer as its GenerateFn."""
    ids = InterruptionTokens(end_of_thinking=4, eos=2, phrase=[30, 31, 32, 4])
    cfg = load_config(
        "scalerl-cpu",
        None,
        ["rollout.interruption.min_thinking_tokens=3", "rollout.interruption.max_thinking_tokens=3"],
    ).rollout

    async def go():
        client = SGLangClient(server.url)
        try:
            generate = as_generate_fn(client, cfg.sampling)
            # a 3-token thinking budget: a random model rarely closes </think> or stops that fast; the
            # loop skips such a sample, so the test is about injection, not luck
            for attempt in range(5):
                out = await generate_completion(generate, [1, 3, 50, 60], cfg, ids, random.Random(attempt), lambda: 0)
                if 4 not in out.tokens[:3] and 2 not in out.tokens[:3]:
                    return out
            raise AssertionError("every sample closed its thinking within 3 tokens")
        finally:
            await client.close()

    out = run(go())
    assert out.tokens[3:7] == [30, 31, 32, 4]
    assert out.loss_mask[:3] == [True] * 3 and out.loss_mask[3:7] == [False] * 4
    assert out.logprobs[3:7] == [0.0] * 4 and all(lp < 0 for lp in out.logprobs[:3])
    assert out.finish_reason in ("interrupted", "length")
    assert len(out.tokens) == len(out.logprobs) == len(out.versions) == len(out.loss_mask)


def test_killed_server_raises_typed_error_and_restart_recovers(server):
    """Last in the module: kills the shared server and brings it back through the balancer's hook."""
    assert server.alive()
    first = server.scratch  # the temp directory of this start: SGLang's socket files are in it
    assert first is not None and any(first.iterdir())
    os.killpg(server.pid, signal.SIGKILL)  # the whole process group: HTTP server, scheduler, detokenizer
    server.process.wait()

    async def go():
        client = SGLangClient(server.url, connect_retries=0)
        try:
            with pytest.raises(EngineUnavailableError):
                await client.generate(PROMPTS[0], 4, [], T1)
            assert not await client.health()
            balancer = EngineBalancer([client], T1, max_retries=1)

            async def restart(failed: SGLangClient) -> None:
                await server.restart(timeout_s=400)
                failed.url = server.url

            balancer.on_failure = restart
            segment = await balancer(PROMPTS[0], 4, [])
            return segment, balancer.failures, balancer.retries, await client.weight_version()
        finally:
            await client.close()

    segment, failures, retries, version = run(go())
    assert len(segment.tokens) == 4 or segment.finish == "stop"
    assert failures == 1 and retries == 1 and server.restarts == 1
    assert version == 0  # a restarted engine serves its launch weights until the next sync
    assert not first.exists() and server.scratch is not None and server.scratch.is_dir()
    second, pgid = server.scratch, server.pid
    server.stop()
    assert server.scratch is None and not second.exists()  # nothing of the server left in the temp directory
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # nothing of the server is left
    # A stop is not a crash: SGLang's crash diagnostics (5 s of sleep before a py-spy and CUDA dump) stay off on CPU.
    stopped = server.log_path.read_text().rsplit("SIGTERM received", 1)[-1]
    assert "crash diagnostics" not in stopped and "kill_process_tree" in stopped
