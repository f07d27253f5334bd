"""Tools a policy calls while it reasons, and the registry a task's tools come from.

A call is written in the tool-call format of Qwen's and Hermes' chat templates (docs of the template:
https://qwen.readthedocs.io/en/latest/framework/function_call.html), which a tiny tokenizer learns as well:

    <tool_call>
    {"name": "python", "arguments": {"code": "print(987 + 654)"}}
    </tool_call>

The engine stops at the closing marker (one token: `rollout.tools.call_end`), the call runs here, and its result
comes back as the next environment segment inside `rollout.tools.response_template`
(`<tool_response>...</tool_response>`, as the templates show tool results).

Adding a tool is one class with `name`, `description`, `parameters` (a JSON schema) and
`run(arguments, cfg) -> ToolResult`, entered in TOOLS. A prompt that declares tools shows them to the policy
through the chat template's `tools` (`schema`).
A tool never raises for what the policy wrote: bad arguments, a crash, a timeout are a ToolResult whose text
says so, and the trajectory counts them. Output is bounded by `rollout.tools.max_output_bytes` and cut visibly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from megatron_rl.config import SandboxConfig, ToolsConfig
from megatron_rl.rewards.sandbox import RunResult, get_sandbox

ToolStatus = Literal["ok", "error", "timeout", "malformed"]


@dataclass
class ToolResult:
    text: str
    """What the policy is shown (already bounded)."""
    status: ToolStatus
    """ok; error (the tool ran and failed: an exception, a crash, a memory or output limit); timeout; malformed
    (the call could not be read, or named an unknown tool or wrong arguments: nothing ran)."""
    truncated: bool = False
    """The output was longer than `max_output_bytes` and was cut."""


class Tool(Protocol):
    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]
    """The arguments' JSON schema, shown to the policy in its prompt (`schema`)."""

    def run(self, arguments: dict[str, Any], cfg: ToolsConfig) -> ToolResult:
        """Runs one call (blocking; the trajectory runs it off the event loop)."""
        ...


def bounded(text: str, max_bytes: int) -> tuple[str, bool]:
    """`text` cut to `max_bytes` of UTF-8, with a marker saying how much was cut (the policy sees that it was)."""
    data = text.encode()
    if len(data) <= max_bytes:
        return text, False
    head = data[:max_bytes].decode(errors="ignore")
    return f"{head}\n[output truncated: {len(data) - max_bytes} more bytes]", True


class PythonTool:
    """Runs the `code` argument as a Python program in the reward sandbox (rewards/sandbox.py: no network, an
    empty read-only root with a private scratch /tmp, limits on time, memory, processes and output); returns
    what it printed, or its error, or that it timed out."""

    name: ClassVar[str] = "python"
    description: ClassVar[str] = "Runs a Python program and returns what it prints."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program"}},
        "required": ["code"],
    }

    def __init__(self, allow_unisolated: bool = False) -> None:
        self.allow_unisolated = allow_unisolated

    def sandbox_config(self, cfg: ToolsConfig) -> SandboxConfig:
        return SandboxConfig(
            wall_time_s=cfg.call_time_s,
            cpu_time_s=cfg.call_time_s,
            memory_mb=cfg.memory_mb,
            max_processes=8,
            # a little past what is shown, so that a flood is cut by the sandbox early but the policy still
            # sees a full window and the marker
            max_output_bytes=2 * cfg.max_output_bytes + 4096,
            allow_unisolated=self.allow_unisolated,
        )

    def run(self, arguments: dict[str, Any], cfg: ToolsConfig) -> ToolResult:
        code = arguments.get("code")
        if set(arguments) != {"code"} or not isinstance(code, str):
            return ToolResult(f'error: python takes {{"code": "<program>"}}, got {sorted(arguments)}', "malformed")
        result = get_sandbox(self.sandbox_config(cfg)).run(code)
        return describe(result, cfg)


def describe(result: RunResult, cfg: ToolsConfig) -> ToolResult:
    """A sandbox run as the text the policy sees: its stdout, then its error or the limit it hit."""
    out = result.stdout.decode(errors="replace")
    err = result.stderr.decode(errors="replace").strip()
    status: ToolStatus = "ok"
    if result.status == "timeout":
        status, note = "timeout", f"[timeout: killed after {cfg.call_time_s:g} s]"
    elif result.status == "output_limit":
        status, note = "error", "[output limit: the program was killed]"
    elif result.status == "memory":
        status, note = "error", f"[memory limit: killed at {cfg.memory_mb} MB]"
    elif result.status != "ok":
        # the last lines of a traceback say what went wrong; the host's frames of the launcher do not matter
        status, note = "error", "\n".join(err.splitlines()[-3:]) or f"[exit status {result.exit_code}]"
    else:
        note = err
    # the output and the note are bounded apart, so a flood never hides why the program stopped
    out, truncated = bounded(out.rstrip("\n"), cfg.max_output_bytes)
    note, note_cut = bounded(note, max(cfg.max_output_bytes, 256))  # a limit's note or a traceback's last lines
    text = "\n".join(part for part in (out, note) if part)
    truncated = truncated or note_cut
    return ToolResult(text, status, truncated)


TOOLS: dict[str, type[PythonTool]] = {PythonTool.name: PythonTool}
"""Tools by the name a dataset row declares and a call names."""


def schema(name: str) -> dict[str, Any]:
    """A tool as chat templates take it (`apply_chat_template(..., tools=[...])`, the OpenAI function format):
    Qwen's and Hermes' templates list these in the system prompt, the tiny tokenizer's names them."""
    tool = TOOLS[name]
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def build_tools(names: list[str] | tuple[str, ...], allow_unisolated: bool = False) -> dict[str, Tool]:
    """The tools of these names, ready to run; an unknown name raises naming it and the known ones."""
    unknown = [name for name in names if name not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}: known tools are {sorted(TOOLS)}")
    return {name: TOOLS[name](allow_unisolated) for name in names}


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]


def parse_call(body: str, tools: dict[str, Tool]) -> Call | ToolResult:
    """The call between the markers, or (a malformed call) the text that tells the policy why it was not run."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolResult(f"error: the tool call is not JSON ({e.msg} at character {e.pos})", "malformed")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolResult('error: a tool call is {"name": "<tool>", "arguments": {...}}', "malformed")
    if data["name"] not in tools:
        return ToolResult(f"error: unknown tool {data['name'][:64]!r}; available: {sorted(tools)}", "malformed")
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolResult("error: a tool call's arguments are a JSON object", "malformed")
    return Call(data["name"], arguments)


def format_call(name: str, arguments: dict[str, Any], cfg: ToolsConfig) -> str:
    """A call as the policy writes it (the warm-up's worked solutions and tests write calls with it)."""
    return f"{cfg.call_start}\n{json.dumps({'name': name, 'arguments': arguments})}\n{cfg.call_end}"
