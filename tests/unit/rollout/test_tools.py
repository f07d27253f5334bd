"""The tool layer without processes: call parsing, the registry, bounded output, a sandbox result's text."""

from megatron_rl.config import ToolsConfig
from megatron_rl.rewards.sandbox import RunResult
from megatron_rl.rollout.tools import TOOLS, Call, PythonTool, ToolResult, bounded, build_tools, describe, parse_call

CFG = ToolsConfig(max_output_bytes=16, call_time_s=2.0)


def test_parse_call_reads_the_json_call_and_answers_bad_ones():
    tools = build_tools(["python"])
    assert parse_call('\n{"name": "python", "arguments": {"code": "1"}}\n', tools) == Call("python", {"code": "1"})
    assert parse_call("{", tools).status == "malformed"
    assert parse_call("[1]", tools).status == "malformed"
    assert "unknown tool 'calc'" in parse_call('{"name": "calc", "arguments": {}}', tools).text
    assert parse_call('{"name": "python", "arguments": 3}', tools).status == "malformed"


def test_registry_and_unknown_names():
    assert TOOLS["python"] is PythonTool
    try:
        build_tools(["python", "browser"])
    except ValueError as e:
        assert "['browser']" in str(e) and "['python']" in str(e)
    else:
        raise AssertionError("an unknown tool was accepted")


def test_python_rejects_wrong_arguments_without_running():
    assert PythonTool().run({"source": "print(1)"}, CFG).status == "malformed"


def test_bounded_cuts_visibly_by_bytes():
    assert bounded("abc", 3) == ("abc", False)
    text, cut = bounded("é" * 10, 5)  # 20 bytes; a 2-byte character is not split
    assert cut and text == "éé\n[output truncated: 15 more bytes]"


def test_describe_each_status():
    def result(status, out=b"", err=b"", code=0):
        return RunResult(status, code, out, err, 0.1, 0.1)

    assert describe(result("ok", b"1579\n"), CFG) == ToolResult("1579", "ok")
    crash = describe(result("crash", b"", b"Traceback\n  File x\nZeroDivisionError: division by zero", 1), CFG)
    assert crash == ToolResult("Traceback\n  File x\nZeroDivisionError: division by zero", "error")
    assert describe(result("timeout", b"", b"", None), CFG) == ToolResult("[timeout: killed after 2 s]", "timeout")
    flood = describe(result("output_limit", b"y" * 100), CFG)
    assert flood.status == "error" and flood.truncated
    assert flood.text == "y" * 16 + "\n[output truncated: 84 more bytes]\n[output limit: the program was killed]"
