"""The judge's process of a judged code test: runs the dataset's test program as written, never the solution.

Runs inside its own sandbox (rewards/judge.py starts it as the sandbox's main program, with `values.py`,
`spec.json` and the fallback `pytest` and `numpy` modules beside it). The test's units (HumanEval's
`check(candidate)`, MBPP's asserts, pytest-style blocks, LeetCode design-class sequences) run here in one
namespace, after the dataset's setup code (the prompt's helpers and imports). The names the test uses that
neither it nor the builtins define, and `candidate` (the entry point), are `Remote` proxies: using one sends a
request to the host, which relays it to the solution's process (rewards/solution_runtime.py) and relays the
reply back. A reply decodes to plain values (rewards/values.py) or to another `Remote` for an object of the
solution's; nothing the solution wrote runs here.

- Equality, order and containment are never asked of the solution: a `Remote` equals only itself, and refuses
  order; truth, length, iteration, `str`, item and attribute reads are asked of it (they carry no expected
  value). A NaN from the solution refuses every comparison and arithmetic (only `math.isnan` and friends read
  it), so no tolerance check passes on it.
- An exception the solution raised is raised here as the builtin class it derives from (so `except ValueError`
  and `pytest.raises(ValueError)` work as the dataset intends), marked as the solution's. The solution's end
  (timeout, memory, crash), a value over the limits, or an exception that is not an `Exception` (SystemExit)
  fails the unit that was running however the test catches it, and every later use of the solution.
- A module the solution imported (`math`) is imported here from the standard library, never proxied.

Verdicts go to the host as one line per unit: {"unit": i, "outcome": null | failure reason}. Standard library
only.
"""

import builtins
import contextlib
import importlib
import json
import os
import sys

import values

_CHANNEL = None


class SolutionGone(BaseException):
    """The solution cannot answer (ended, over a limit): a BaseException, so `except Exception` in a test does
    not swallow it (and the unit fails whatever the test catches)."""


class SolutionRaised:
    """Marks an exception raised here on behalf of the solution."""


_RAISED: dict = {}


def _raised_class(name: str) -> type:
    if name not in _RAISED:
        base = getattr(builtins, name, None)
        if not (isinstance(base, type) and issubclass(base, Exception)):
            base = Exception
        _RAISED[name] = type(base.__name__, (base, SolutionRaised), {"__module__": "solution"})
    return _RAISED[name]


class SolutionNaN(float):
    """A NaN the solution returned: any comparison or arithmetic raises, so `not abs(x - y) > tol` cannot pass
    on it; `math.isnan(x)` still reads True."""

    def __new__(cls) -> "SolutionNaN":
        return super().__new__(cls, "nan")

    def _refuse(self, *args):
        raise TypeError("a NaN returned by the solution cannot be compared or computed with")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __abs__ = __neg__ = _refuse
    __pos__ = __round__ = __bool__ = __int__ = __trunc__ = __floor__ = __ceil__ = __divmod__ = _refuse
    __hash__ = float.__hash__


class Remote:
    """A function, class or object of the solution's, in its process; every use is a request there."""

    __slots__ = ("_ref", "_label")

    def __init__(self, ref: dict, label: str) -> None:
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_label", label)

    def __call__(self, *args, **kwargs):
        return _CHANNEL.call(self, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _CHANNEL.request("getattr", self, attr=name)

    def __setattr__(self, name: str, value) -> None:
        raise TypeError(f"the solution's {self._label} is read-only in the test")

    def __bool__(self) -> bool:
        return _plain(_CHANNEL.request("bool", self), bool)

    def __len__(self) -> int:
        return _plain(_CHANNEL.request("len", self), int)

    def __iter__(self):
        return iter(_CHANNEL.request("iter", self))

    def __str__(self) -> str:
        return _plain(_CHANNEL.request("str", self), str)

    def __getitem__(self, key):
        return _CHANNEL.request("getitem", self, key=_CHANNEL.encode(key))

    def __repr__(self) -> str:
        return f"<solution's {self._label}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Remote) and other._ref == self._ref

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(json.dumps(self._ref, sort_keys=True))

    def _refuse(self, *args):
        raise TypeError(f"the solution's {self._label} cannot be ordered or searched by the test")

    __lt__ = __le__ = __gt__ = __ge__ = __contains__ = _refuse


def _plain(value, kind: type):
    if type(value) is not kind:
        raise TypeError(f"the solution answered a {type(value).__name__} where Python requires a {kind.__name__}")
    return value


class Channel:
    """Requests to the solution through the host, one at a time; records why the running unit must fail."""

    def __init__(self, inbox, outbox, limits: "values.Limits") -> None:
        self.inbox, self.outbox, self.limits = inbox, outbox, limits
        self.number = 0
        self.gone = None  # why the solution cannot answer any more
        self.failure = None  # why the running unit fails whatever the test catches

    def send(self, message: dict) -> None:
        self.outbox.write(values.dumps(message) + "\n")
        self.outbox.flush()

    def receive(self) -> dict:
        line = self.inbox.readline()
        if not line:
            os._exit(0)  # the host has ended the judgement
        return values.loads(line)

    def encode(self, value):
        def handle(obj):
            if isinstance(obj, Remote) and "handle" in obj._ref:
                return {"t": "handle", "v": obj._ref["handle"], "type": obj._label}
            raise TypeError(f"a {type(obj).__name__} cannot be passed to the solution (values only)")

        try:
            return values.encode(value, self.limits, handle)
        except values.ValueLimit as exc:
            raise TypeError(f"the test's argument cannot cross to the solution: {exc}") from None

    def fail(self, reason: str):
        self.failure = self.failure or reason
        raise SolutionGone(reason)

    def call(self, remote: Remote, args: tuple, kwargs: dict):
        encoded = [self.encode(arg) for arg in args]
        reply = self.request("call", remote, args=encoded, kwargs=self.encode(kwargs), _reply=True)
        for index, data in reply.get("mutated") or ():
            if type(index) is not int or not 0 <= index < len(args):
                self.fail("crash")
            _copy_into(args[index], self.decode(data))
        return self.decode(reply["value"])

    def request(self, op: str, remote: Remote, _reply: bool = False, **fields):
        if self.gone is not None:
            self.fail(self.gone)
        self.number += 1
        self.send({"id": self.number, "op": op, "target": remote._ref, **fields})
        try:
            reply = self.receive()
        except values.ValueLimit:
            self.fail("crash")
        if type(reply) is not dict:
            self.fail("crash")
        if "gone" in reply:
            self.gone = str(reply["gone"])
            self.fail(self.gone)
        if reply.get("id") != self.number:
            self.fail("crash")  # out of turn: a reply the solution wrote ahead, or from another thread
        if "limit" in reply:
            self.fail("output_limit")
        if reply.get("ok") is False:
            if reply.get("exception") is not True:
                self.fail("crash")  # SystemExit, KeyboardInterrupt, ...: the solution gave up
            error = _raised_class(str(reply.get("error")))(str(reply.get("message", ""))[:500])
            raise error
        if reply.get("ok") is not True or "value" not in reply:
            self.fail("crash")
        return reply if _reply else self.decode(reply["value"])

    def decode(self, data):
        try:
            return values.decode(data, self.limits, self._handle, nan=SolutionNaN)
        except values.ValueLimit:
            self.fail("output_limit")

    @staticmethod
    def _handle(tagged: dict) -> Remote:
        return Remote({"handle": tagged["v"]}, str(tagged.get("type"))[:80] + " object")


def _copy_into(original, new) -> None:
    """Change `original` in place to equal `new`, keeping the identity of nested lists and dicts."""
    if isinstance(original, list) and isinstance(new, list):
        if len(original) == len(new):
            for index, (old, fresh) in enumerate(zip(original, new, strict=False)):
                if type(old) is type(fresh) and isinstance(old, list | dict | set):
                    _copy_into(old, fresh)
                else:
                    original[index] = fresh
        else:
            original[:] = new
    elif isinstance(original, dict) and isinstance(new, dict):
        for key in [k for k in original if k not in new]:
            del original[key]
        for key, fresh in new.items():
            old = original.get(key)
            if key in original and type(old) is type(fresh) and isinstance(old, list | dict | set):
                _copy_into(old, fresh)
            else:
                original[key] = fresh
    elif isinstance(original, set) and isinstance(new, set):
        original.clear()
        original.update(new)
    elif isinstance(original, bytearray) and isinstance(new, bytearray):
        original[:] = new


def _names_used(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def _bind(namespace: dict, names: set, solution: dict) -> None:
    """Bind what the test uses of the solution's names, except what the test or the builtins define."""
    for name in names:
        if name in namespace or hasattr(builtins, name) or name not in solution:
            continue
        kind = solution[name]
        if kind.startswith("module:"):
            module = kind[len("module:") :]
            if module.split(".")[0] in sys.stdlib_module_names and not module.startswith("_"):
                with contextlib.suppress(ImportError):
                    namespace[name] = importlib.import_module(module)
            continue
        remote = Remote({"name": name}, name)
        if kind == "value":  # a constant the test reads: fetched once, as plain data
            try:
                namespace[name] = _CHANNEL.request("get", remote)
            except (SolutionGone, Exception):
                _CHANNEL.failure = None
            continue
        namespace[name] = remote


def _install_fallbacks(here: str) -> None:
    """Our `pytest` (raises, approx) and, without a real numpy, our `numpy` (the comparisons tests use)."""
    import importlib.util

    for module, filename in (("pytest", "judge_pytest.py"), ("numpy", "judge_numpy.py")):
        if module == "numpy" and importlib.util.find_spec("numpy") is not None:
            continue
        spec = importlib.util.spec_from_file_location(module, os.path.join(here, filename))
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        spec.loader.exec_module(loaded)
        for _name, value in list(vars(loaded).items()):
            if isinstance(value, type(sys)) and value.__name__.startswith(module + "."):
                sys.modules[value.__name__] = value


def main() -> None:
    global _CHANNEL
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "spec.json")) as f:
        spec = json.load(f)
    inbox = os.fdopen(os.dup(0), "rb")
    outbox = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the test's own prints go nowhere
    _CHANNEL = Channel(inbox, outbox, values.Limits(**spec["limits"]))
    _install_fallbacks(here)
    hello = _CHANNEL.receive()
    solution = hello.get("names") if type(hello) is dict else None
    units = spec["units"]
    if type(solution) is not dict:
        for index in range(len(units)):
            _CHANNEL.send({"unit": index, "outcome": "crash"})
        _CHANNEL.send({"done": True})
        return
    solution = {str(k): str(v) for k, v in solution.items()}
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    setup_failed = None
    try:
        exec(compile(spec["setup"], "<setup>", "exec"), namespace)
    except BaseException as exc:  # the dataset's setup failed: every unit fails, and stderr says why
        setup_failed = "crash"
        sys.stderr.write(f"test setup failed: {type(exc).__name__}: {exc}\n")
    entry = spec.get("entry_point")
    if entry:
        remote = Remote({"name": entry}, entry)
        namespace[entry] = remote  # over the prompt's stub: the entry point is always the solution's
        namespace.setdefault("candidate", remote)
    for index, source in enumerate(units):
        outcome = setup_failed or _run_unit(index, source, namespace, solution)
        _CHANNEL.send({"unit": index, "outcome": outcome})
    _CHANNEL.send({"done": True})


def _run_unit(index: int, source: str, namespace: dict, solution: dict):
    _CHANNEL.failure = None
    try:
        code = compile(source, f"<test {index}>", "exec")
        _bind(namespace, _names_used(code), solution)
        _CHANNEL.failure = None
        exec(code, namespace)
        outcome = None
    except AssertionError:
        outcome = "wrong_answer"
    except SolutionGone as exc:
        outcome = str(exc)
    except MemoryError:
        outcome = "memory"
    except BaseException as exc:  # the solution raised and the test did not expect it: it crashed
        outcome = "crash" if isinstance(exc, SolutionRaised) else "wrong_answer"
        sys.stderr.write(f"test {index}: {type(exc).__name__}: {str(exc)[:200]}\n")
    return _CHANNEL.failure or outcome


if __name__ == "__main__":
    main()
