"""Assert-based code tests judged outside the sandbox: the sandbox computes values, the host decides.

A test like `assert f(3) == 9` used to run whole in the sandbox, next to the solution, which reported "ok".
Everything in that process is the solution's to change (the report channel, the harness's globals, `json`,
`AssertionError`, the builtins), and an object whose `__eq__` answers True passes any `==`. So an RL policy could
learn to forge the verdict instead of solving the task. Here the verdict never comes from the sandbox:

    plan = plan_asserts(["assert f(3) == 9", "for n in range(3): assert abs(f(n) - n * n) < 1e-9"])
    plan.steps   -> the expressions the sandbox evaluates: ["f(3)", "f(0)", "f(1)", "f(2)"]
    plan.judge(values) -> [None, None] or a failure reason per statement, from the values as plain data

- Each statement is split into probes (the calls, names and attributes that reach the solution, with loop
  variables substituted by their values) and the rest, which the host evaluates with only plain values bound and
  a small set of pure builtins. The expected values (the `9`, the `n * n`) never enter the sandbox, so they cannot
  be read there, and a forged report can only carry values: to pass, they must be the right ones.
- Values cross as tagged JSON (rewards/values.py) that decodes only to builtin types (int, float, str, bytes,
  bool, None, list, tuple, set, frozenset, dict); anything else decodes to an `Opaque` value that refuses every
  use. No object of the solution's ever reaches the host, so none of its methods run there.
- Supported statements: `assert EXPR[, MSG]`; `for NAME in ITER:` over such statements, with an ITER the host can
  evaluate (unrolled, at most `MAX_UNROLL` iterations); `NAME = EXPR` (evaluated in the sandbox and bound on both
  sides). Comprehensions over a host-evaluable iterable are unrolled the same way. Anything else (`def`, `import`,
  `while`, `try`, lambdas, comprehensions over solution values) is refused at load with the construct named, since
  it could only be judged by running it next to the solution.
- Probes are evaluated eagerly and in order, so a short-circuit (`x is None or f(x)`) still evaluates every probe;
  a probe that raises fails its statement only if the host needs its value.
"""

from __future__ import annotations

import ast
import builtins
import math
from dataclasses import dataclass, field
from typing import Any

MAX_UNROLL = 10_000
"""Iterations of a test's loop or comprehension that are unrolled into probes."""

_HOST_BUILTINS: dict[str, Any] = {
    name: getattr(builtins, name)
    for name in (
        "abs", "all", "any", "bool", "dict", "enumerate", "float", "frozenset", "int", "len", "list", "max", "min",
        "range", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "zip", "isinstance", "type",
    )
}  # fmt: skip
_HOST_NAMES = {**_HOST_BUILTINS, "math": math, "True": True, "False": False, "None": None}


class UnsupportedTest(ValueError):
    """An assert-based test the host cannot judge without running the test code next to the solution."""


class ProbeFailed(Exception):
    """The host needed the value of a probe that raised in the sandbox."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class Opaque:
    """A value the sandbox reported that is not plain data (an object of the solution's, or a malformed report).
    Any use but identity raises TypeError (truth, equality, order, hashing), so a statement that needs it fails:
    an object cannot pass `assert f(x)` or `assert f(x) != 0` by being unusual."""

    __slots__ = ("type_name", "text")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name, self.text = type_name, text

    def _refuse(self, *args: Any) -> Any:
        raise TypeError(f"a {self.type_name} value is not plain data")

    __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __len__ = __iter__ = _refuse  # type: ignore

    def __repr__(self) -> str:
        return f"<{self.type_name}: {self.text}>"


@dataclass
class Step:
    """One expression for the sandbox: evaluated in the solution's namespace (bound to `assign` if set)."""

    expr: str
    assign: str | None = None


@dataclass
class _Check:
    """One statement's judgement: the host expression over probe placeholders, and the steps it needs."""

    statement: int
    code: Any  # compiled host expression, or None for an assignment
    first: int
    last: int  # steps[first:last] belong to this statement
    binds: str | None = None


@dataclass
class AssertPlan:
    statements: list[str]
    steps: list[Step] = field(default_factory=list)
    checks: list[_Check] = field(default_factory=list)

    def judge(self, results: list[tuple[bool, Any]], missing: str = "crash") -> list[str | None]:
        """A failure reason (or None) per statement, from the sandbox's (ok, value-or-error) per step.

        A statement whose probes were not all reported (the run ended early) fails with `missing` (how the run
        ended: timeout, memory, crash, ...); "wrong_answer" when the host finds it false; a probe error the host
        needed is "wrong_answer" for an AssertionError raised by the solution, else "crash"."""
        env: dict[str, Any] = {}
        per_statement: dict[int, list[str | None]] = {}
        for check in self.checks:
            per_statement.setdefault(check.statement, []).append(self._judge_one(check, results, env, missing))
        return [next((o for o in per_statement.get(i, []) if o is not None), None) for i in range(len(self.statements))]

    def _judge_one(
        self, check: _Check, results: list[tuple[bool, Any]], env: dict[str, Any], missing: str
    ) -> str | None:
        if len(results) < check.last:
            return missing
        bound: dict[str, Any] = {}
        for position in range(check.first, check.last):
            ok, value = results[position]
            bound[f"__probe_{position}"] = _Failed(value) if not ok else value
        if check.binds is not None:  # NAME = EXPR: the sandbox's value, bound for later statements
            (value,) = bound.values()
            env[check.binds] = value
            return None
        try:
            verdict = bool(_host_eval(check.code, {**env, **bound}))
        except ProbeFailed as failed:
            return "wrong_answer" if failed.error == "AssertionError" else "crash"
        except Exception:
            return "wrong_answer"  # the host's own evaluation failed on the values (a type error, say)
        return None if verdict else "wrong_answer"


@dataclass(frozen=True)
class _Failed:
    error: str


class _FailedProbeGuard(ast.NodeTransformer):
    """Host code reads a probe through `__get(...)`, which raises ProbeFailed for a probe that raised."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id.startswith("__probe_"):
            return ast.Call(ast.Name("__get", ast.Load()), [node], [])
        return node


def _get(value: Any) -> Any:
    if isinstance(value, _Failed):
        raise ProbeFailed(value.error)
    return value


def _host_eval(code: Any, names: dict[str, Any]) -> Any:
    return eval(code, {"__builtins__": {}, **_HOST_NAMES, "__get": _get}, names)  # noqa: S307 (no solution code)


def plan_asserts(statements: list[str]) -> AssertPlan:
    """The probes and host checks of assert-based tests; UnsupportedTest names what cannot be judged."""
    plan = AssertPlan(list(statements))
    known: set[str] = set()
    for index, source in enumerate(statements):
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            raise UnsupportedTest(f"asserts[{index}]: not Python: {exc.msg}") from None
        for statement in tree.body:
            _plan_statement(plan, statement, {}, known, index)
    return plan


def _plan_statement(plan: AssertPlan, node: ast.stmt, loop: dict[str, Any], known: set[str], index: int) -> None:
    where = f"asserts[{index}]"
    if isinstance(node, ast.Assert):
        first = len(plan.steps)
        host = _Probes(plan, loop, known, where).rewrite(node.test)
        expression = ast.fix_missing_locations(ast.Expression(_FailedProbeGuard().visit(host)))
        plan.checks.append(_Check(index, compile(expression, "<test>", "eval"), first, len(plan.steps)))
    elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and not node.orelse:
        values = _host_constant(node.iter, loop, known, where)
        for value in values:
            for inner in node.body:
                _plan_statement(plan, inner, {**loop, node.target.id: value}, known, index)
    elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        name = node.targets[0].id
        first = len(plan.steps)
        plan.steps.append(Step(ast.unparse(_substitute(node.value, loop)), assign=name))
        plan.checks.append(_Check(index, None, first, first + 1, binds=name))
        known.add(name)
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return  # a docstring or a bare constant: nothing to judge
    else:
        kind = type(node).__name__
        raise UnsupportedTest(
            f"{where}: a {kind} statement cannot be judged outside the sandbox (supported: assert, for over a "
            "host-evaluable iterable, NAME = expression)"
        )


def _host_constant(node: ast.expr, loop: dict[str, Any], known: set[str], where: str) -> list[Any]:
    """A loop's or comprehension's iterable, evaluated on the host (no solution value in it)."""
    expression = _substitute(node, loop)
    if _reaches_solution(expression, set()):
        raise UnsupportedTest(f"{where}: a loop over solution values ({ast.unparse(node)}) cannot be unrolled")
    values = list(_host_eval(compile(ast.Expression(expression), "<iter>", "eval"), {}))
    if len(values) > MAX_UNROLL:
        raise UnsupportedTest(f"{where}: a loop of {len(values)} iterations (at most {MAX_UNROLL} are unrolled)")
    for value in values:
        _literal(value, where)
    return values


def _literal(value: Any, where: str) -> ast.expr:
    """The AST of a plain value, as it reads back (loop variables substituted into probes)."""
    text = repr(value)
    try:
        if ast.literal_eval(text) != value:
            raise ValueError
    except (ValueError, SyntaxError):
        raise UnsupportedTest(f"{where}: a loop value {text[:40]} is not a plain literal") from None
    return ast.parse(text, mode="eval").body


def _substitute(node: ast.expr, loop: dict[str, Any]) -> ast.expr:
    if not loop:
        return node

    class Substitute(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.AST:
            if isinstance(name.ctx, ast.Load) and name.id in loop:
                return _literal(loop[name.id], "loop")
            return name

    return ast.fix_missing_locations(Substitute().visit(ast.parse(ast.unparse(node), mode="eval")).body)


def _is_math(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "math"


def _reaches_solution(node: ast.AST, local: set[str]) -> bool:
    """Whether evaluating `node` needs a name the host does not have (a solution's), or an attribute other than
    `math.*`, or a dunder."""
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and child.id not in _HOST_NAMES and child.id not in local:
            return True
        math_attribute = (
            isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "math"
        )
        if isinstance(child, ast.Attribute) and (not math_attribute or child.attr.startswith("_")):
            return True
        if isinstance(child, ast.Lambda | ast.NamedExpr | ast.Await | ast.Yield | ast.YieldFrom | ast.Starred):
            return True
    return False


class _Probes:
    """Rewrites a test expression: every part that reaches the solution becomes a probe placeholder."""

    def __init__(self, plan: AssertPlan, loop: dict[str, Any], known: set[str], where: str) -> None:
        self.plan, self.loop, self.known, self.where = plan, loop, known, where

    def rewrite(self, node: ast.expr) -> ast.expr:
        node = _substitute(node, self.loop)
        return self._visit(node)

    def _probe(self, node: ast.expr) -> ast.expr:
        position = len(self.plan.steps)
        self.plan.steps.append(Step(ast.unparse(node)))
        return ast.Name(f"__probe_{position}", ast.Load())

    def _visit(self, node: ast.expr) -> ast.expr:
        if not _reaches_solution(node, self.known):
            return node
        if isinstance(node, ast.Name):
            if node.id in self.known:  # bound by an earlier NAME = EXPR: the host holds its plain value
                return node
            return self._probe(node)
        if isinstance(node, ast.Call):
            pure = isinstance(node.func, ast.Name) and node.func.id in _HOST_BUILTINS
            pure = pure or (
                isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "math" and not node.func.attr.startswith("_")
            )  # fmt: skip
            if not pure:
                return self._probe(node)
            node.args = [self._visit(arg) for arg in node.args]
            node.keywords = [ast.keyword(k.arg, self._visit(k.value)) for k in node.keywords]
            return node
        if isinstance(node, ast.Attribute | ast.Subscript):
            return self._probe(node)
        if isinstance(node, ast.ListComp | ast.GeneratorExp | ast.SetComp):
            return self._unroll(node)
        if isinstance(node, ast.Lambda | ast.DictComp | ast.NamedExpr | ast.Starred):
            raise UnsupportedTest(f"{self.where}: {type(node).__name__} over solution values cannot be judged")
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, name, self._visit(value))
            elif isinstance(value, list):
                setattr(node, name, [self._visit(v) if isinstance(v, ast.expr) else v for v in value])
        return node

    def _unroll(self, node: ast.ListComp | ast.GeneratorExp | ast.SetComp) -> ast.expr:
        """`[f(x) for x in range(3) if x]` -> `[f(1), f(2)]` (a tuple for a generator, a set display for a set)."""
        if len(node.generators) != 1 or node.generators[0].is_async:
            raise UnsupportedTest(f"{self.where}: a nested comprehension over solution values cannot be judged")
        comp = node.generators[0]
        if not isinstance(comp.target, ast.Name):
            raise UnsupportedTest(f"{self.where}: a comprehension must bind one name to be unrolled")
        elements = []
        for value in _host_constant(comp.iter, self.loop, self.known, self.where):
            inner = {**self.loop, comp.target.id: value}
            keep = True
            for condition in comp.ifs:
                condition = _substitute(condition, inner)
                if _reaches_solution(condition, self.known):
                    raise UnsupportedTest(f"{self.where}: a comprehension filtering on solution values")
                keep = keep and bool(_host_eval(compile(ast.Expression(condition), "<if>", "eval"), {}))
            if keep:
                elements.append(self._visit(_substitute(node.elt, inner)))
        if isinstance(node, ast.SetComp):
            return ast.Set(elements) if elements else ast.Call(ast.Name("set", ast.Load()), [], [])
        return ast.List(elements, ast.Load()) if isinstance(node, ast.ListComp) else ast.Tuple(elements, ast.Load())
