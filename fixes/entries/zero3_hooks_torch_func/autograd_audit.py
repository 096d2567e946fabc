"""Which ``torch.autograd.Function`` subclasses an installed DeepSpeed defines, which of them use the
legacy ``forward(ctx, ...)`` pattern that ``torch.func`` transforms refuse, and which of them a
training job actually runs.

* :func:`audit_autograd_functions` reads the source (an AST walk, so classes defined inside
  functions, like ZeRO-3's per-module hook classes, are found too, and nothing is imported);
* :func:`applied_autograd_functions` records, while a block runs, every Function whose ``apply`` ran;
* :func:`audit_table` joins the two into the rows a notebook prints.

A class is *legacy* when it defines ``forward`` and no ``setup_context`` (PyTorch then requires
``forward`` to take ``ctx`` first and raises under any functorch transform: "it must override the
setup_context staticmethod").
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


@dataclass(frozen=True)
class AutogradFunction:
    """One ``autograd.Function`` subclass found in the source."""

    file: str  # relative to the package root's parent, e.g. deepspeed/runtime/zero/linear.py
    name: str
    qualname: str  # dotted path of enclosing classes/functions, e.g. DeepSpeedZeRoOffload._register_deepspeed_module.PreBackwardFunctionForModule
    line: int
    forward_args: tuple[str, ...] | None  # None: forward is inherited
    has_setup_context: bool
    has_vmap_rule: bool = False  # ``generate_vmap_rule = True`` or a ``vmap`` staticmethod

    @property
    def legacy(self) -> bool:
        """Defines ``forward`` but no ``setup_context``: refused under torch.func transforms."""
        return self.forward_args is not None and not self.has_setup_context

    @property
    def key(self) -> tuple[str, str]:
        return self.file, self.name


def _is_function_base(base: ast.expr, known: set[str]) -> bool:
    """``torch.autograd.Function``, ``autograd.Function``, ``Function`` (imported from torch.autograd),
    ``torch.autograd.function.Function``, or a class already known to be one."""
    if isinstance(base, ast.Attribute):
        return base.attr == "Function" and "autograd" in ast.unparse(base)
    return isinstance(base, ast.Name) and (base.id == "Function" or base.id in known)


def _staticmethod_args(node: ast.ClassDef, method: str) -> tuple[str, ...] | None:
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
            return tuple(arg.arg for arg in [*item.args.posonlyargs, *item.args.args])
    return None


def _has_vmap_rule(node: ast.ClassDef) -> bool:
    for item in node.body:
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "generate_vmap_rule"
                                                for t in item.targets):
            return isinstance(item.value, ast.Constant) and item.value.value is True
    return _staticmethod_args(node, "vmap") is not None


def _classes(tree: ast.AST) -> Iterator[tuple[ast.ClassDef, str]]:
    """Every class in ``tree`` with its dotted qualname (enclosing classes and functions included)."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[ast.ClassDef, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}.{child.name}" if prefix else child.name
                if isinstance(child, ast.ClassDef):
                    yield child, qualname
                yield from walk(child, qualname)
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def audit_autograd_functions(package_dir: str | os.PathLike[str] | None = None) -> list[AutogradFunction]:
    """Every ``autograd.Function`` subclass defined in the package at ``package_dir`` (default: the
    installed ``deepspeed``), sorted by file and line. Subclasses of DeepSpeed's own Functions are
    included (matched by class name within the package)."""
    if package_dir is None:
        import importlib.util

        spec = importlib.util.find_spec("deepspeed")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("deepspeed is not installed")
        package_dir = list(spec.submodule_search_locations)[0]
    root = Path(package_dir)
    return _scan(sorted(root.rglob("*.py")), root.parent)


def audit_file(path: str | os.PathLike[str]) -> list[AutogradFunction]:
    """The ``autograd.Function`` subclasses defined in one source file (file names as in
    :func:`audit_autograd_functions` when the file lies inside a ``deepspeed`` package)."""
    path = Path(path)
    parts = path.parts
    root = path.parent
    for index, part in enumerate(parts):
        if part == "deepspeed" and (Path(*parts[:index + 1]) / "__init__.py").exists():
            root = Path(*parts[:index])
            break
    return _scan([path], root)


def _scan(paths: list[Path], root: Path) -> list[AutogradFunction]:
    """The Function subclasses defined in ``paths``. A class is one when a base is ``Function`` (plain or
    dotted) or the name of a class already found, so only a file whose text holds ``Function`` or such a name can
    define one: only those files are parsed, each once (its classes walked once), and the search for subclasses
    of subclasses goes on over the classes parsed, to a fixpoint."""
    texts: dict[Path, str] = {}
    for path in paths:
        try:
            texts[path] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    classes: dict[Path, list[tuple[ast.ClassDef, str]]] = {}  # the parsed files' classes, with their qualnames
    known: set[str] = set()
    searched: set[str] = set()  # the names the unparsed files' texts were searched for
    found: dict[tuple[str, str, int], AutogradFunction] = {}
    while True:  # to a fixpoint, so subclasses of subclasses are found wherever they are defined
        names = ({"Function"} | known) - searched
        searched |= names
        for path, text in texts.items():
            if path not in classes and any(name in text for name in names):
                try:
                    classes[path] = list(_classes(ast.parse(text)))
                except SyntaxError:
                    classes[path] = []
        before = len(found)
        for path, defined in classes.items():
            relative = path.relative_to(root).as_posix()
            for node, qualname in defined:
                if any(_is_function_base(base, known) for base in node.bases):
                    known.add(node.name)
                    found[relative, qualname, node.lineno] = AutogradFunction(
                        relative, node.name, qualname, node.lineno, _staticmethod_args(node, "forward"),
                        _staticmethod_args(node, "setup_context") is not None, _has_vmap_rule(node))
        if len(found) == before and not known - searched:
            break
    return sorted(found.values(), key=lambda f: (f.file, f.line))


@contextlib.contextmanager
def applied_autograd_functions() -> Iterator[set[type]]:
    """Within the block, record every ``torch.autograd.Function`` subclass whose ``apply`` runs.

    Replaces the classmethod ``torch.autograd.Function.apply`` and puts the very same object back.
    Classes that override ``apply`` themselves are not seen (none in DeepSpeed does).
    """
    import torch

    owner = torch.autograd.Function
    original = vars(owner)["apply"]  # a classmethod (a C classmethod_descriptor on newer torch)
    seen: set[type] = set()

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        seen.add(cls)
        return original.__get__(None, cls)(*args, **kwargs)  # bound to cls, either kind of classmethod

    owner.apply = classmethod(apply)  # type: ignore[assignment]
    try:
        yield seen
    finally:
        owner.apply = original  # type: ignore[assignment]


def runtime_key(cls: type) -> tuple[str, str]:
    """(file, class name) of a Function class, spelled as :attr:`AutogradFunction.key` spells it."""
    path = Path(inspect.getsourcefile(cls) or "")
    parts = path.parts
    for index, part in enumerate(parts):  # the package root: the first "deepspeed" holding __init__.py
        if part == "deepspeed" and (Path(*parts[:index + 1]) / "__init__.py").exists():
            return Path(*parts[index:]).as_posix(), cls.__name__
    return path.as_posix(), cls.__name__


def audit_table(functions: list[AutogradFunction], reached: set[type] | set[tuple[str, str]]) -> list[dict[str, Any]]:
    """Rows for :func:`fixes.harness.print_table`: file, class, legacy or not, reached or not.
    ``reached`` holds classes (from :func:`applied_autograd_functions`) or their keys."""
    keys = {item if isinstance(item, tuple) else runtime_key(item) for item in reached}
    return [{
        "file": f.file,
        "line": f.line,
        "class": f.qualname,
        "legacy forward(ctx, ...)": "LEGACY" if f.legacy else ("inherits forward" if f.forward_args is None else "no"),
        "setup_context": "yes" if f.has_setup_context else "no",
        "vmap rule": "yes" if f.has_vmap_rule else "no",
        "reached by ZeRO-3 training": "REACHED" if f.key in keys else "",
    } for f in functions]
