"""A class's methods, properties and attributes read from its source with
``ast`` (nothing imported), and whether one method's signature can stand in
for another's: what tools/vllm_compat.py compares KVBMConnector and vLLM's
connector base class with.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # posonly, positional, vararg, kwonly, varkw
    default: str | None  # source text, None when required


@dataclass(frozen=True)
class Member:
    name: str
    kind: str  # method, property, classmethod, staticmethod, attribute
    params: tuple[Param, ...] = ()
    abstract: bool = False
    line: int = 0

    def signature(self) -> str:
        parts = []
        for p in self.params:
            name = {"vararg": "*", "varkw": "**"}.get(p.kind, "") + p.name
            parts.append(name if p.default is None else f"{name}={p.default}")
        return f"{self.name}({', '.join(parts)})"


def _decorators(node: ast.FunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute):
            names.add(target.attr)
        elif isinstance(target, ast.Name):
            names.add(target.id)
    return names


def _params(args: ast.arguments) -> tuple[Param, ...]:
    out: list[Param] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "posonly" if i < len(args.posonlyargs) else "positional"
        out.append(Param(arg.arg, kind, None if default is None else ast.unparse(default)))
    if args.vararg:
        out.append(Param(args.vararg.arg, "vararg", None))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(Param(arg.arg, "kwonly", None if default is None else ast.unparse(default)))
    if args.kwarg:
        out.append(Param(args.kwarg.arg, "varkw", None))
    return tuple(out)


def class_members(source: str, class_name: str) -> dict[str, Member]:
    """Methods, properties and class attributes a class defines, from its source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            break
    else:
        raise LookupError(f"no class {class_name} in the source")
    members: dict[str, Member] = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decos = _decorators(item)
            kind = next(
                (k for k in ("property", "classmethod", "staticmethod") if k in decos), "method"
            )
            if kind == "method" and ({"setter", "deleter"} & decos):
                continue  # part of a property already recorded
            members[item.name] = Member(
                item.name, kind, _params(item.args), "abstractmethod" in decos, item.lineno
            )
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    members[t.id] = Member(t.id, "attribute", line=item.lineno)
    return members


def signature_problem(ours: Member, base: Member) -> str | None:
    """Why ``ours`` cannot stand in for ``base`` (None: it can)."""
    if ours.kind != base.kind:
        return f"is a {ours.kind}, vLLM's is a {base.kind}"
    if ours.kind in ("property", "attribute"):
        return None
    theirs = list(base.params)
    mine = list(ours.params)
    for i, b in enumerate(theirs):
        if b.kind in ("vararg", "varkw"):
            # vLLM may pass anything there: we must accept it too.
            if not any(p.kind == b.kind for p in mine):
                return (
                    f"lacks {'*' if b.kind == 'vararg' else '**'}{b.name} of vLLM's "
                    f"{base.signature()}"
                )
            continue
        match = (
            mine[i]
            if i < len(mine) and b.kind in ("posonly", "positional")
            else next((p for p in mine if p.name == b.name), None)
        )
        if match is None or match.name != b.name or match.kind != b.kind:
            got = "nothing" if match is None else f"{match.kind} {match.name!r}"
            return (
                f"parameter {i} is {got}, vLLM passes {b.kind} {b.name!r}: "
                f"ours {ours.signature()} vs vLLM's {base.signature()}"
            )
        if match.default != b.default:
            return (
                f"default of {b.name!r} is {match.default}, vLLM's is {b.default}: "
                f"ours {ours.signature()} vs vLLM's {base.signature()}"
            )
    names = {b.name for b in theirs}
    for p in mine:
        if p.name not in names and p.kind not in ("vararg", "varkw") and p.default is None:
            return (
                f"requires {p.name!r}, which vLLM never passes: ours "
                f"{ours.signature()} vs vLLM's {base.signature()}"
            )
    return None
