"""Judged code tests: the dataset's test program runs in one sandbox, the solution in another, and the host
relays values between them.

    outcomes = judge(program, {"asserts": ["assert f(1) == 2"], "setup": "", "entry_point": "f"}, cfg)
    # one failure reason (or None for a pass) per test unit

Two sandboxes (rewards/sandbox.py `Session`), both network-less, each with the sandbox's limits:

- the judge's process (rewards/judge_runtime.py) runs the dataset's setup and test units as written; the
  solution's names it uses are proxies, and it alone writes the verdict of each unit;
- the solution's process (rewards/solution_runtime.py) runs the model's program and answers the judge's
  requests (call, attribute, ...) with tagged plain values (rewards/values.py).

The host forwards each request line of the judge to the solution and exactly one reply line back; it reads
verdicts from the judge only. A reply is never interpreted here, only bounded (one line of at most
`max_output_bytes`); the judge decodes it into plain values. A solution that writes out of turn, writes a line
over the limit, or ends, is ended, and the judge is told it is gone: the unit running and every later use of the
solution fail with how it ended. Both processes share the wall-time budget `wall_time_s`; units without a
verdict when it runs out fail with 'timeout' (or with how the judge ended, if it did).

What isolates the verdict from the solution: no code of the solution's runs in the judge's process (values
decode to builtin types; objects stay in the solution's process behind handles), the test's expected values and
helpers live only in the judge's process, and the two processes share nothing but the relayed lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import time
from pathlib import Path
from typing import Any

from megatron_rl.config import SandboxConfig
from megatron_rl.rewards.sandbox import RunResult, Session, get_sandbox

_HERE = Path(__file__).parent
JUDGE_SOURCE = (_HERE / "judge_runtime.py").read_text()
SOLUTION_SOURCE = (_HERE / "solution_runtime.py").read_text()
_SHARED = {"values.py": (_HERE / "values.py").read_text(), "judge_pytest.py": (_HERE / "judge_pytest.py").read_text()}
_JUDGE_FILES = {**_SHARED, "judge_numpy.py": (_HERE / "judge_numpy.py").read_text()}

VALUE_DEPTH = 64
"""Nesting depth of one value crossing between the two processes."""
VALUE_ITEMS = 200_000
"""Items (containers and scalars) of one value crossing between the two processes."""

OUTCOMES = ("wrong_answer", "timeout", "memory", "crash", "output_limit", "compile_error")


def value_limits(cfg: SandboxConfig) -> dict[str, int]:
    """The limits of one crossing value: its text is bounded by `max_output_bytes`, like a program's output."""
    return {"depth": VALUE_DEPTH, "items": VALUE_ITEMS, "chars": cfg.max_output_bytes}


def judge(program: str, tests: dict[str, Any], cfg: SandboxConfig) -> list[str | None]:
    """Run the test units of `tests` (data/assert_tests.py's judged form) against `program`: per unit, None for a
    pass or the failure reason."""
    units = list(tests["asserts"])
    common = {"setup": tests.get("setup") or "", "limits": value_limits(cfg)}
    judge_spec = {**common, "units": units, "entry_point": tests.get("entry_point")}
    sandbox = get_sandbox(cfg)
    solution = sandbox.start(SOLUTION_SOURCE, {**_SHARED, "solution.py": program, "spec.json": json.dumps(common)})
    try:
        judge_process = sandbox.start(JUDGE_SOURCE, {**_JUDGE_FILES, "spec.json": json.dumps(judge_spec)})
    except BaseException:
        solution.finish()
        raise
    relay = _Relay(cfg, judge_process, solution, len(units))
    try:
        return relay.run()
    finally:
        relay.close()


class _Peer:
    """One side of the relay: its session, unread output, pending writes, stderr tail."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.buffer = bytearray()
        self.outgoing = bytearray()
        self.stderr = bytearray()
        self.output = 0
        self.result: RunResult | None = None
        self.limit = ""

    @property
    def alive(self) -> bool:
        return self.result is None


class _Relay:
    def __init__(self, cfg: SandboxConfig, judge_session: Session, solution_session: Session, units: int) -> None:
        self.cfg = cfg
        self.judge, self.solution = _Peer(judge_session), _Peer(solution_session)
        self.outcomes: dict[int, str | None] = {}
        self.units = units
        self.deadline = min(judge_session.start, solution_session.start) + cfg.wall_time_s
        self.hello = False  # the solution announced its names
        self.pending = False  # a request awaits the solution's reply
        self.gone: str | None = None  # how the solution ended
        self.done = False
        self.selector = selectors.DefaultSelector()
        for peer in (self.judge, self.solution):
            self.selector.register(peer.session.stdout, selectors.EVENT_READ, (peer, "stdout"))
            self.selector.register(peer.session.stderr, selectors.EVENT_READ, (peer, "stderr"))
            self.selector.register(peer.session.pidfd, selectors.EVENT_READ, (peer, "exit"))
            os.set_blocking(peer.session.stdin, False)

    def run(self) -> list[str | None]:
        while not self.done and self.judge.alive:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self._end(self.solution, "timeout")
                self._end(self.judge, "timeout")
                break
            for peer in (self.judge, self.solution):
                self._want_write(peer)
            for key, events in self.selector.select(remaining):
                peer, what = key.data
                if not peer.alive:
                    continue
                if events & selectors.EVENT_WRITE and what == "stdin":
                    self._flush(peer)
                elif what == "exit":
                    self._drain(peer)
                    self._end(peer, "")
                else:
                    self._read(peer, what)
        if self.judge.alive and self.done:
            self._end(self.judge, "")
        ended = self.judge.result.status if self.judge.result is not None else "crash"
        missing = "timeout" if ended == "timeout" else ("memory" if ended == "memory" else "crash")
        return [self.outcomes.get(index, missing) if index in self.outcomes else missing for index in range(self.units)]

    def close(self) -> None:
        for peer in (self.judge, self.solution):
            if peer.alive:
                self._end(peer, "")
        self.selector.close()

    def _want_write(self, peer: _Peer) -> None:
        fd = peer.session.stdin
        registered = fd in self.selector.get_map()
        if peer.outgoing and peer.alive and not registered:
            self.selector.register(fd, selectors.EVENT_WRITE, (peer, "stdin"))
        elif registered and (not peer.outgoing or not peer.alive):
            self.selector.unregister(fd)

    def _flush(self, peer: _Peer) -> None:
        try:
            written = os.write(peer.session.stdin, peer.outgoing[: 1 << 16])
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            peer.outgoing.clear()  # it stopped reading: it has ended or will, and is judged by how
            return
        del peer.outgoing[:written]

    def _send(self, peer: _Peer, line: bytes) -> None:
        if peer.alive:
            peer.outgoing += line + b"\n"
            self._flush(peer)

    def _drain(self, peer: _Peer) -> None:
        """Read what an ended process left in its pipes."""
        for what, fd in (("stdout", peer.session.stdout), ("stderr", peer.session.stderr)):
            for _ in range(64):
                if not peer.alive or not self._read(peer, what, fd):
                    break

    def _read(self, peer: _Peer, what: str, fd: int | None = None) -> bool:
        fd = fd if fd is not None else (peer.session.stdout if what == "stdout" else peer.session.stderr)
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(fd)
            return False
        if what == "stderr":
            peer.stderr += chunk
            peer.output += len(chunk)
            if len(peer.stderr) > 8192:
                del peer.stderr[:-4096]
            if peer.output > self.cfg.max_output_bytes:
                self._end(peer, "output_limit")
            return True
        peer.buffer += chunk
        while peer.alive and b"\n" in peer.buffer:
            line, _, rest = bytes(peer.buffer).partition(b"\n")
            peer.buffer = bytearray(rest)
            if peer is self.judge:
                self._from_judge(line)
            else:
                self._from_solution(line)
        if peer.alive and len(peer.buffer) > self.cfg.max_output_bytes:
            self._end(peer, "output_limit")
        return True

    def _from_judge(self, line: bytes) -> None:
        if line.startswith(b'{"id"'):  # a request for the solution
            if self.gone is not None:
                self._send(self.judge, json.dumps({"gone": self.gone}).encode())
            else:
                self.pending = True
                self._send(self.solution, line)
            return
        message = json.loads(line)
        if "unit" in message:
            outcome = message.get("outcome")
            self.outcomes[int(message["unit"])] = outcome if outcome in OUTCOMES else None
        elif message.get("done"):
            self.done = True

    def _from_solution(self, line: bytes) -> None:
        if not self.hello:
            self.hello = True
            self._send(self.judge, line)
        elif self.pending:
            self.pending = False
            self._send(self.judge, line)
        else:  # out of turn (written ahead, or by a thread of its own): the channel is no longer one reply a call
            self._end(self.solution, "crash")

    def _end(self, peer: _Peer, limit: str) -> None:
        if not peer.alive:
            return
        for fd in (peer.session.stdout, peer.session.stderr, peer.session.pidfd, peer.session.stdin):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(fd)
        peer.result = peer.session.finish(limit, bytes(peer.stderr))
        if peer is self.solution:
            status = peer.result.status
            self.gone = "crash" if status == "ok" else status
            if not self.hello:
                # It never started: every unit fails as it ended (compile_error, ...); the judge is not needed.
                self.outcomes = {index: self.gone for index in range(self.units)}
                self.done = True
            elif self.pending:
                self.pending = False
                self._send(self.judge, json.dumps({"gone": self.gone}).encode())
