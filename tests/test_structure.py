"""The package's shape: an import graph without circles, and layers that import only downwards."""

import ast
from pathlib import Path

import rope_extend

PACKAGE = Path(rope_extend.__file__).parent


def _module_name(path: Path) -> str:
    parts = ["rope_extend", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The rope_extend modules ``path`` imports, at any depth of its code (lazy imports count too)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("rope_extend") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_modules_import_without_circles():
    graph = import_graph()
    assert len(graph) > 30
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_parts_import_without_circles():
    """Collapsed to the package's parts (methods, hf, evaluation, training, bundled, and each top module),
    the graph is still without circles: each part sits above the parts it uses."""
    graph: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        part = ".".join(name.split(".")[:2])
        graph.setdefault(part, set()).update(".".join(t.split(".")[:2]) for t in targets)
    for part, targets in graph.items():
        targets.discard(part)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_nothing_inside_imports_the_public_facade():
    """``rope_extend/__init__`` is the public API on top; inner modules import the module that does the work."""
    graph = import_graph()
    inner = [name for name, targets in graph.items() if "rope_extend" in targets and name != "rope_extend"]
    assert inner == []


def test_hf_layers():
    """hf.families (the family rules) sits under everything of hf but the rope-type vocabulary; hf.config is
    below rotary, head and register; hf.transformers_changes is the top (nothing imports it but the facade, and
    hf.ulysses, whose sequence-parallel attention is the one change made for a run rather than at import), and
    only it imports hf.register."""
    graph = import_graph()
    assert not graph["rope_extend.hf.config"] & {
        "rope_extend.hf.rotary",
        "rope_extend.hf.head",
        "rope_extend.hf.register",
        "rope_extend.patching",
    }
    rules = [name for name in graph if name.startswith("rope_extend.hf.families")]
    assert len(rules) >= 4
    hf_below = {t for name in rules for t in graph[name] if t.startswith("rope_extend.hf.")}
    assert hf_below - set(rules) == {"rope_extend.hf.rope_types"}
    importers = sorted(n for n, t in graph.items() if "rope_extend.hf.register" in t)
    assert importers == ["rope_extend.hf.transformers_changes"]
    importers = sorted(n for n, t in graph.items() if "rope_extend.hf.transformers_changes" in t)
    assert importers == ["rope_extend", "rope_extend.hf.ulysses"]


def test_the_version_agrees_with_pyproject():
    import re

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1) == rope_extend.__version__


# Every module keeps both limits: the list of modules once excused while they were split is gone (issue 56
# emptied it), and a new excuse would be a change to these numbers, reviewed as such.
MAX_LINES = 450
MAX_POSITIONAL = 6


def positional_parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters a call may pass by position, ``self`` / ``cls`` left out (``*args`` and keyword-only
    parameters are not counted)."""
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _long_modules() -> dict[str, int]:
    """``{module path: lines}`` for every module of the package over ``MAX_LINES`` lines."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            out[path.relative_to(PACKAGE).as_posix()] = lines
    return out


def _wide_functions() -> dict[str, list[str]]:
    """``{module path: ["line name(parameters)", ...]}`` for every function of the package with more than
    ``MAX_POSITIONAL`` positional parameters."""
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = positional_parameters(node)
                if len(params) > MAX_POSITIONAL:
                    where = path.relative_to(PACKAGE).as_posix()
                    out.setdefault(where, []).append(f"{node.lineno} {node.name}({', '.join(params)})")
    return out


def test_no_module_is_over_450_lines():
    long = _long_modules()
    assert long == {}, f"modules over {MAX_LINES} lines (split them): {long}"


def test_no_function_takes_more_than_6_positional_parameters():
    wide = _wide_functions()
    assert wide == {}, (
        f"functions with more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only or pass a "
        f"small dataclass): {wide}"
    )


def test_positional_parameters_are_counted_as_a_call_passes_them():
    tree = ast.parse("def f(a, b, c, /, d, e, f, g, *args, h=1): ...\nclass C:\n    def m(self, a, *, b): ...")
    f, m = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert positional_parameters(f) == ["a", "b", "c", "d", "e", "f", "g"]
    assert positional_parameters(m) == ["a"]


# The four extension points register one way (rope_extend.registry's docstring): one Registry each, the built-in
# entries listed by module path under it, nothing registered as a side effect of an import, and no function that
# only wraps a registry's method.
REGISTRIES = {
    "rope_extend.methods.registry": "METHODS",
    "rope_extend.hf.families.rule": "RULES",
    "rope_extend.evaluation.tasks.base": "TASKS",
    "rope_extend.export.targets": "TARGETS",
}
REGISTRY_METHODS = {"register", "register_lazy", "unregister", "get", "names", "values", "on_register", "on_unregister"}


def _registering(tree: ast.Module) -> list[str]:
    """The ``.register*`` methods a module calls when imported (in its top-level statements, not in a function or
    class body)."""
    out = []
    for statement in tree.body:
        if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            calls = [n for n in ast.walk(statement) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            out += [c.func.attr for c in calls if c.func.attr.startswith("register")]
    return out


def _wrapping(tree: ast.Module) -> list[str]:
    """The functions whose body (a docstring aside) is one ``return REGISTRY.method(...)``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        call = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in REGISTRY_METHODS:
            owner = call.func.value
            if getattr(owner, "id", None) in REGISTRIES.values() or getattr(owner, "attr", None) in REGISTRIES.values():
                out.append(node.name)
    return out


def _package_trees() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.rglob("*.py"))}


def test_built_in_entries_are_listed_by_path_under_their_registry():
    registering = {name: found for name, tree in _package_trees().items() if (found := _registering(tree))}
    assert registering == {module: ["register_lazy"] for module in REGISTRIES}


def test_no_function_wraps_a_registry():
    wrapping = {name: found for name, tree in _package_trees().items() if (found := _wrapping(tree))}
    assert wrapping == {}


def test_the_registration_checks_can_fail():
    tree = ast.parse(
        "RULES.register(Rule('x', 'scale_keys', f))\n"
        "def f():\n    TASKS.register(t)\n"
        "def get(name):\n    'doc'\n    return registry.METHODS.get(name)\n"
        "def other(name):\n    return METHODS.get(name) or None\n"
    )
    assert _registering(tree) == ["register"] and _wrapping(tree) == ["f", "get"]


def test_each_registry_lists_its_built_ins_before_importing_them():
    """In a fresh interpreter every built-in entry is listed and none loaded until asked for; each loads as the
    entry its name says."""
    import subprocess
    import sys

    code = (
        "import importlib\n"
        "from rope_extend.registry import Registry, _Lazy\n"
        f"for module, name in {REGISTRIES!r}.items():\n"
        "    registry = getattr(importlib.import_module(module), name)\n"
        "    assert isinstance(registry, Registry) and len(registry) >= 4, (module, registry)\n"
        "    assert all(isinstance(item, _Lazy) for item in registry._items.values()), (module, registry)\n"
        "    assert [item.name for item in registry.values()] == registry.names(), module\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
