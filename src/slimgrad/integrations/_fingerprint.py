"""A normalised syntax-tree fingerprint of a function, for recognising upstream forwards slimgrad reproduces.

Every integration that replaces an upstream forward (transformers' norms and MLPs, diffusers' activations,
peft's LoRA layers, bitsandbytes' quantized linears) must first know that the forward installed is one it
has read. Comparing source text breaks on every cosmetic edit (a dropped type annotation, a comment, a
reformatted call, an expression split over two statements) and then silently stops converting; comparing
behaviour needs a module to run. This fingerprint compares what the code *does*, written any of those ways:

* parsed with :mod:`ast` (comments, line breaks and parentheses vanish);
* docstrings and other bare string statements, type annotations (parameters, returns, annotated
  assignments), decorators and the function's name dropped;
* parameters other than a leading ``self``/``cls`` renamed by position (``hidden_states`` or ``x``);
* single-use temporaries in straight-line code inlined (``h = a * b; return self.down(h)`` is
  ``return self.down(a * b)``), only where that cannot reorder calls: the temporary is bound once, read
  once, in the very next statement, and no call or other effect of that statement runs before the read;
* serialised by our own walk (all fields, empty ones left out), so the hash does not depend on the Python
  version's ``ast.dump`` format.

A changed constant, operator, call, attribute or argument changes the fingerprint. The hash is the first
16 hex digits of the serialisation's SHA-256. ``python -m slimgrad.integrations._fingerprint module:Class.method``
prints a fingerprint and the normalised source it was taken from (to extend the tables of known versions).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable, Iterator, Mapping

__all__ = ["Verified", "fingerprint", "names_read", "normalise", "source_fingerprint", "unknown_reason"]

_EFFECTS = (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)
_SKIPPED_FIELDS = {"kind", "type_comment", "type_params"}


def _function_node(source: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    node = tree.body[0] if len(tree.body) == 1 else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _source_of(obj) -> str | None:
    if isinstance(obj, str):
        return obj
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


# --- normalisation steps ---------------------------------------------------------------------------------

def _is_string_statement(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


class _Strip(ast.NodeTransformer):
    """Drops docstrings (any bare string statement), annotations and decorators, everywhere in the tree."""

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and all(isinstance(s, ast.stmt) for s in stmts):
                kept = [s for s in stmts if not _is_string_statement(s)]
                setattr(node, field, kept or [ast.Pass()])
        return node

    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_FunctionDef(self, node):
        node.decorator_list, node.returns = [], None
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node):
        if node.value is None:  # a bare declaration does nothing at run time
            return None
        if not node.simple or not isinstance(node.target, ast.Name):
            return ast.Assign(targets=[self.visit(node.target)], value=self.visit(node.value))
        return ast.Assign(targets=[node.target], value=self.visit(node.value))


def _all_args(a: ast.arguments) -> list[ast.arg]:
    return [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
            *([a.kwarg] if a.kwarg else [])]


def _rename_parameters(fn: ast.FunctionDef) -> None:
    params = _all_args(fn.args)
    if params and params[0].arg in ("self", "cls") and (fn.args.posonlyargs or fn.args.args):
        params = params[1:]
    names = {p.arg: f"_p{i}" for i, p in enumerate(params)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in names:
            node.id = names[node.id]
        elif isinstance(node, ast.arg) and node.arg in names:
            node.arg = names[node.arg]


def _post_order(node: ast.AST, target: ast.Name, found: list) -> bool:
    """Walk ``node`` in evaluation order (children before their node, fields left to right); returns False
    as soon as an effect (a call, an await, a walrus) is evaluated before ``target``, which is recorded in
    ``found`` when reached unconditionally. Parts evaluated conditionally or repeatedly (lambda bodies,
    comprehensions, ``a if c else b`` branches, ``and``/``or`` tails) are opaque: an effect when they hold
    one, and never where the temporary may be substituted."""
    if found:
        return True
    if node is target:
        found.append(node)
        return True
    conditional: list[ast.AST] = []
    if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        conditional = [node]
        children: list[ast.AST] = []
    elif isinstance(node, ast.IfExp):
        children, conditional = [node.test], [node.body, node.orelse]
    elif isinstance(node, ast.BoolOp):
        children, conditional = node.values[:1], node.values[1:]
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        if not _post_order(child, target, found):
            return False
        if found:
            return True
    for part in conditional:
        if any(isinstance(n, _EFFECTS) for n in ast.walk(part)):
            return False
    return not isinstance(node, _EFFECTS)


_SITE_FIELD = {ast.Return: "value", ast.Expr: "value", ast.Assign: "value", ast.If: "test"}


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.Name, value: ast.expr):
        self.target, self.value = target, value

    def visit_Name(self, node):
        return self.value if node is self.target else node


def _statement_lists(node: ast.AST) -> Iterator[list[ast.stmt]]:
    for sub in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(sub, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


def _inline_temporaries(fn: ast.FunctionDef) -> None:
    """Substitute each single-use temporary into the next statement, where that reorders nothing.

    A temporary qualifies when the whole function names it exactly twice (this binding, one read) and never
    as a parameter or ``global``/``nonlocal``, the read lies in the part of the very next statement that is
    evaluated first and unconditionally (a return or expression value, an assignment's value, an ``if``
    test), and nothing with an effect is evaluated before the read there. Each statement list is swept
    backwards, so chains (``a = f(x); b = g(a); return b``) collapse in one pass.
    """
    counts: dict[str, int] = {}
    excluded: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            counts[node.id] = counts.get(node.id, 0) + 1
        elif isinstance(node, ast.arg):
            excluded.add(node.arg)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            excluded.update(node.names)
    for body in list(_statement_lists(fn)):
        for i in range(len(body) - 2, -1, -1):
            stmt, nxt = body[i], body[i + 1]
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
                continue
            name = stmt.targets[0].id
            field = _SITE_FIELD.get(type(nxt))
            if name in excluded or counts.get(name) != 2 or field is None:
                continue
            site = getattr(nxt, field)
            read = next((n for n in ast.walk(site) if isinstance(n, ast.Name) and n.id == name), None)
            if read is None or not isinstance(read.ctx, ast.Load):
                continue
            found: list = []
            if not _post_order(site, read, found) or not found:
                continue
            setattr(nxt, field, stmt.value if site is read else _Replace(read, stmt.value).visit(site))
            del body[i]
            counts[name] = 0


def normalise(obj: Callable | str) -> ast.FunctionDef | None:
    """The normalised syntax tree of function ``obj`` (or of the source of one ``def``); None when its
    source cannot be read or is not a single function definition."""
    source = _source_of(obj)
    fn = _function_node(source) if source is not None else None
    if fn is None:
        return None
    fn = _Strip().visit(fn)  # a tree parsed for this call: changed in place
    fn.name = "f"
    _rename_parameters(fn)
    _inline_temporaries(fn)
    return fn


# --- serialisation ----------------------------------------------------------------------------------------

def _serialise(node) -> str:
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            if name in _SKIPPED_FIELDS:
                continue
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            fields.append(f"{name}={_serialise(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_serialise(v) for v in node) + "]"
    return f"{type(node).__name__}:{node!r}"


def _hash(fn: ast.FunctionDef) -> str:
    text = _serialise(fn.args) + "|" + _serialise(fn.body)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(obj: Callable | str) -> str | None:
    """The fingerprint of function ``obj`` (a function, method, or the source of one ``def``); None when its
    source cannot be read."""
    fn = normalise(obj)
    return None if fn is None else _hash(fn)


def names_read(obj: Callable | str) -> frozenset[str]:
    """The global and attribute names function ``obj``'s code reads (its ``co_names``): equal fingerprints
    imply equal sets, so comparing them first spares fingerprinting functions that cannot match. Empty
    when ``obj`` has no code object."""
    if isinstance(obj, str):
        module = compile(textwrap.dedent(obj), "<source>", "exec")
        code = next((c for c in module.co_consts if hasattr(c, "co_names")), None)
    else:
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    return frozenset(getattr(code, "co_names", ()))


def source_fingerprint(source: str) -> str:
    """The fingerprint of the source of one ``def`` (a reference written in an integration); raises
    ValueError naming slimgrad when ``source`` is not one."""
    fp = fingerprint(source)
    if fp is None:
        raise ValueError(f"slimgrad: source_fingerprint needs the source of one function definition, got "
                         f"{source[:60]!r}")
    return fp


def _qualified(obj) -> str:
    obj = getattr(obj, "__func__", obj)
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def unknown_reason(methods: Mapping[str, object], known: Mapping[str, Mapping[str, str]]) -> str | None:
    """None when every function in ``methods`` (label -> function, or None for a missing one) has a
    fingerprint listed for its label in ``known`` (label -> {fingerprint: versions it was read in});
    otherwise a reason naming the first function slimgrad does not know."""
    for label, fn in methods.items():
        table = known.get(label, {})
        if fn is None:
            return f"{label} is missing (slimgrad knows it from {_versions(table)})"
        fp = fingerprint(fn)
        if fp is None:
            return f"the source of {label} ({_qualified(fn)}) cannot be read, so slimgrad cannot check it"
        if fp not in table:
            return (f"{label} ({_qualified(fn)}, fingerprint {fp}) is not a version slimgrad has read and "
                    f"reproduces (known from {_versions(table)})")
    return None


def _versions(table: Mapping[str, str]) -> str:
    return ", ".join(sorted(set(table.values()))) or "no version"


class Verified:
    """The upstream functions one replacement reproduces, checked against a table of known fingerprints.

    ``functions`` maps a label to ``(owner, attribute)`` (a class or module and the name of the function on
    it), read at every check, so a helper renamed upstream is "missing" rather than an ImportError, and a
    forward monkey-patched after import is seen. :meth:`reason` re-fingerprints only when one of the
    functions changed identity; while it is not None the ``classes`` are recorded as gaps of ``family``
    (:func:`slimgrad._notices.record_class_gap`), so ``convert`` warns about them, and forgotten again once
    the functions are known and the class is registered.
    """

    def __init__(self, functions: Mapping[str, tuple[object, str]], known: Mapping[str, Mapping[str, str]], *,
                 classes: tuple[type, ...], library: str, family: str):
        self.functions, self.known = dict(functions), known
        self.classes, self.library, self.family = classes, library, family
        self._seen: tuple | None = None
        self._reason: str | None = None

    def current(self) -> dict[str, object]:
        return {label: getattr(owner, name, None) for label, (owner, name) in self.functions.items()}

    def still_known(self) -> bool:
        """Whether the functions last checked were known and none has been replaced since (cheap: for the
        forward of a converted module, which runs upstream's own forward otherwise)."""
        if self._reason is not None or self._seen is None:
            return False
        return all(getattr(getattr(owner, name, None), "__func__", getattr(owner, name, None)) is seen
                   for (owner, name), seen in zip(self.functions.values(), self._seen))

    def reason(self) -> str | None:
        """None when every function is one slimgrad knows; else why not (and the classes are gaps)."""
        from slimgrad import _notices
        from slimgrad._registry import REPLACEMENTS

        functions = self.current()
        seen = tuple(getattr(f, "__func__", f) for f in functions.values())
        if self._seen is None or len(seen) != len(self._seen) or any(a is not b for a, b in zip(seen, self._seen)):
            self._seen, self._reason = seen, unknown_reason(functions, self.known)
            for cls in self.classes:
                if self._reason is not None:
                    _notices.record_class_gap(cls, library=self.library, family=self.family, reason=self._reason)
                elif cls in REPLACEMENTS:
                    _notices.forget_class_gap(cls)
        return self._reason


def _main(argv: list[str]) -> int:
    import importlib

    for spec in argv:
        module_name, _, attr = spec.partition(":")
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part) if part else obj
        fn = normalise(obj)
        print(f"{spec}: {None if fn is None else _hash(fn)}")
        if fn is not None:
            print(textwrap.indent(ast.unparse(fn), "    "))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
