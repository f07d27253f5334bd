"""The solution's process of a judged code test: runs the model's program and answers calls, values only.

Runs inside its own sandbox (rewards/judge.py starts it as the sandbox's main program, with `values.py`,
`solution.py` and `spec.json` beside it). It executes the dataset's setup code and then the solution in one
namespace, announces the solution's top-level names, and then answers one request per line on stdin with one
reply per line on the original stdout:

    {"id": 3, "op": "call", "target": {"name": "f"}, "args": [...], "kwargs": [...]}
        -> {"id": 3, "ok": true, "value": ..., "mutated": [[0, ...]]}
        |  {"id": 3, "ok": false, "error": "ValueError", "message": "...", "exception": true}
        |  {"id": 3, "limit": "value nested deeper than 64"}

Ops: call, getattr, get (a global), iter, bool, len, str, getitem; a target is a global name or a handle (an
object of the solution's that is not plain data, kept here in a table and named by number there).

Nothing here is trusted: the solution can rewrite this module, its channel and the encoder, answer out of turn
or not at all. What it writes only ever reaches the judge's process as a reply that decodes to plain values or
handles (rewards/values.py), and requests carry only the arguments the test passes, never its expected values.
Standard library only.
"""

import contextlib
import json
import os
import sys

import values

COMPILE_ERROR, MEMORY = 113, 114  # the launcher's exit statuses (rewards/sandbox.py)
MAX_HANDLES = 100_000


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "spec.json")) as f:
        spec = json.load(f)
    limits = values.Limits(**spec["limits"])
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the solution reads nothing of the channel through input() and prints into nothing
    os.dup2(null, 1)
    with open(os.path.join(here, "solution.py"), "rb") as f:
        source = f.read()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(COMPILE_ERROR)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    _install_pytest(here)
    try:
        exec(compile(spec["setup"], "setup.py", "exec"), namespace)
        exec(code, namespace)
    except MemoryError:
        os._exit(MEMORY)
    server = Server(namespace, limits)
    replies.write(values.dumps({"names": server.names()}) + "\n")
    replies.flush()
    for line in requests:
        reply = server.answer(line)
        replies.write(reply + "\n")
        replies.flush()


def _install_pytest(here: str) -> None:
    """The judge's `pytest` stand-in (rewards/judge_pytest.py), for setup code that imports it here too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pytest", os.path.join(here, "judge_pytest.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["pytest"] = module
    spec.loader.exec_module(module)


class Server:
    def __init__(self, namespace: dict, limits: "values.Limits") -> None:
        self.namespace, self.limits = namespace, limits
        self.handles: dict = {}

    def names(self) -> dict:
        """Top-level names: 'callable', 'module:<name>' or 'value' (the judge fetches values when it needs them)."""
        kinds = {}
        for name, value in list(self.namespace.items())[:10_000]:
            if name.startswith("__") or type(name) is not str:
                continue
            if type(value) is type(sys):
                kinds[name] = "module:" + str(getattr(value, "__name__", ""))
            else:
                kinds[name] = "callable" if callable(value) else "value"
        return kinds

    def handle(self, obj: object) -> dict:
        if len(self.handles) >= MAX_HANDLES:
            raise values.ValueLimit("too many objects handed to the test")
        number = len(self.handles)
        self.handles[number] = obj
        return {"t": "handle", "v": number, "type": type(obj).__name__, "callable": callable(obj)}

    def lookup(self, tagged: dict) -> object:
        return self.handles[tagged["v"]]

    def target(self, ref: dict) -> object:
        if "handle" in ref:
            return self.handles[ref["handle"]]
        return self.namespace[ref["name"]]

    def answer(self, line: bytes) -> str:
        request = json.loads(line)
        number = request.get("id")
        try:
            value, mutated = self.run(request)
            reply = {"id": number, "ok": True, "value": values.encode(value, self.limits, self.handle)}
            if mutated:
                reply["mutated"] = mutated
        except MemoryError:
            os._exit(MEMORY)
        except values.ValueLimit as exc:
            return values.dumps({"id": number, "limit": str(exc)[:200]})
        except BaseException as exc:  # the solution's exception, reported by name: the judge raises its own
            builtin = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
            message = ""
            with contextlib.suppress(Exception):
                message = str(exc)[:500]
            reply = {"id": number, "ok": False, "error": builtin.__name__, "message": message}
            reply["exception"] = isinstance(exc, Exception)
        try:
            return values.dumps(reply)
        except (ValueError, TypeError) as exc:
            return values.dumps({"id": number, "limit": str(exc)[:200]})

    def run(self, request: dict) -> tuple:
        op = request["op"]
        target = self.target(request["target"])
        if op == "get":
            return target, None
        if op == "call":
            args = values.decode(request["args"], self.limits, self.lookup)
            kwargs = values.decode(request["kwargs"], self.limits, self.lookup)
            before = request["args"]
            result = target(*args, **kwargs)
            # Arguments changed in place go back, so the test sees them changed as it would in one process.
            mutated = []
            for index, arg in enumerate(args):
                if isinstance(arg, list | dict | set | bytearray):
                    after = values.encode(arg, self.limits, self.handle)
                    if after != before[index]:
                        mutated.append([index, after])
            return result, mutated
        if op == "getattr":
            return getattr(target, request["attr"]), None
        if op == "iter":
            items = []
            for item in iter(target):  # materialised here, within the limits: an endless iterator runs into them
                items.append(item)
                if len(items) > self.limits.items:
                    raise values.ValueLimit(f"an iterator of more than {self.limits.items} items")
            return iter(items), None
        if op == "bool":
            return bool(target), None
        if op == "len":
            return len(target), None
        if op == "str":
            return str(target), None
        if op == "getitem":
            return target[values.decode(request["key"], self.limits, self.lookup)], None
        raise ValueError("unknown op")


if __name__ == "__main__":
    main()
