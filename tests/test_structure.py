"""The package's shape: an import graph without circles, and layers that import only downwards."""

import ast
import sys
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


# Every module keeps these limits: the list of modules once excused while they were split is gone (issue 56
# emptied it), and a new excuse would be a change to these numbers, reviewed as such.
MAX_LINES = 450
MAX_POSITIONAL = 6
MAX_FUNCTION_LINES = 80  # issue 65 split the last ones over it into named steps


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


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines from ``def`` to the function's last one: signature, docstring, comments and nested functions
    included, decorators not."""
    return node.end_lineno - node.lineno + 1


def _long_functions() -> dict[str, list[str]]:
    """``{module path: ["line name (lines)", ...]}`` for every function of the package over ``MAX_FUNCTION_LINES``."""
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and function_lines(node) > MAX_FUNCTION_LINES:
                where = path.relative_to(PACKAGE).as_posix()
                out.setdefault(where, []).append(f"{node.lineno} {node.name} ({function_lines(node)} lines)")
    return out


def test_no_function_is_over_80_lines():
    long = _long_functions()
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"


def test_function_lines_count_from_def_to_the_last_line():
    tree = ast.parse('@decorator\ndef f(a):\n    """Doc."""\n\n    # why\n    return a\n')
    (f,) = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert function_lines(f) == 5


def test_positional_parameters_are_counted_as_a_call_passes_them():
    tree = ast.parse("def f(a, b, c, /, d, e, f, g, *args, h=1): ...\nclass C:\n    def m(self, a, *, b): ...")
    f, m = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert positional_parameters(f) == ["a", "b", "c", "d", "e", "f", "g"]
    assert positional_parameters(m) == ["a"]


# ------------------------------------------------------------------------------------------ re-exports
def _parsed() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(encoding="utf-8"))) for p in PACKAGE.rglob("*.py")}


def _from_base(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in module ``name`` reads from."""
    here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    if not node.level:
        return node.module or ""
    base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
    return f"{base}.{node.module}" if node.module else base


def _own_names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _imported_names(name: str, path: Path, tree: ast.Module) -> dict[str, str]:
    """``{local name: module it comes from}`` for every ``from X import y`` of a module, at any depth."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                out[alias.asname or alias.name] = _from_base(name, path, node)
    return out


def _module_aliases(name: str, path: Path, tree: ast.Module, modules: set[str]) -> dict[str, str]:
    """``{local name: rope_extend module}`` for the modules a module binds to a name (``from . import config as
    hf_config``, ``from .hf import rotary``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(name, path, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    out[alias.asname or alias.name] = f"{base}.{alias.name}"
    return out


def reexports() -> dict[str, set[str]]:
    """``{module: names}``: names another package module reads from ``module`` although ``module`` only imported
    them, by ``from module import name``, or as ``module.name`` where ``module`` is a plain module (a package's
    ``__init__`` that lists its API, ``hf.families.ask``, is read by attribute). The public facade
    ``rope_extend/__init__`` is exempt: it is where users import from."""
    parsed = _parsed()
    modules = set(parsed)
    own = {name: _own_names(tree) for name, (_, tree) in parsed.items()}
    imported = {name: _imported_names(name, path, tree) for name, (path, tree) in parsed.items()}
    packages = {name for name, (path, _) in parsed.items() if path.name == "__init__.py"}

    def reexported(source: str, attr: str) -> bool:
        return (
            source != "rope_extend"
            and source in modules
            and f"{source}.{attr}" not in modules
            and attr in imported[source]
            and attr not in own[source]
        )

    found: dict[str, set[str]] = {}
    for name, (path, tree) in parsed.items():
        if name == "rope_extend":
            continue
        aliases = _module_aliases(name, path, tree, modules)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _from_base(name, path, node)
                for alias in node.names:
                    if reexported(source, alias.name):
                        found.setdefault(source, set()).add(alias.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                source = aliases.get(node.value.id, "")
                if source not in packages and reexported(source, node.attr):
                    found.setdefault(source, set()).add(node.attr)
    return found


def test_no_module_re_exports_a_name_inside_the_package():
    """Each name is imported from the module that defines it: a module that re-exports (``hf.config`` once passed
    on 18 names of ``hf.reading`` and ``hf.rope_types``) sends a reader to the wrong file. The facades users import
    from (``rope_extend.methods``, ``methods.registry``'s ``Scaling``/``resolve``, ``rope_extend.evaluation``,
    ``evaluation.ruler``) still list those names; no module of the package reads them there."""
    found = reexports()
    assert found == {}, f"names imported from a module that only re-exports them: {found}"


def test_the_re_export_rule_finds_both_forms(tmp_path, monkeypatch):
    """The rule sees ``from a import y`` and ``a.y`` where ``a`` only imported ``y``, and lets the facade be."""
    package = tmp_path / "rope_extend"
    package.mkdir()
    (package / "__init__.py").write_text("from .b import y\n")
    (package / "a.py").write_text("from .b import y\nz = 1\n")
    (package / "c.py").write_text("from .a import y, z\n")
    (package / "d.py").write_text("from . import a\nprint(a.y, a.z)\n")
    (package / "b.py").write_text("y = 1\n")
    (package / "e.py").write_text("from rope_extend import y\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert reexports() == {"rope_extend.a": {"y"}}


# ------------------------------------------------------------------------------------------ names on transformers
NAMES = "rope_extend.hf.names"
# strings spelled like rope-extend's attribute names that are not placed on a transformers object: a context
# variable's name, a key of an exported config.json, the layout probe's attention-registry name, a vLLM plugin's key
NOT_ATTRIBUTES = {"rope_extend_whole", "rope_extend_adaptive", "rope_extend_probe", "rope_extend_segment"}
NOT_TRANSFORMERS = {"rope_extend.export.vllm_plugin"}  # places its names on vLLM's objects, in its own process


def _constants(tree: ast.Module) -> dict[str, str]:
    """A module's top-level string constants, ``{name: value}``."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update((t.id, node.value.value) for t in node.targets if isinstance(t, ast.Name))
    return out


def _placed_names(name: str, path: Path, tree: ast.Module) -> list[tuple[int, ast.expr]]:
    """``(line, name expression)`` of every attribute a module places on, reads from or takes off another object
    by name: ``x.__dict__[k]``, ``x.__dict__.get/pop/setdefault(k)``, ``setattr/getattr(x, k)``, ``object.__setattr__
    (x, k, v)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__":
            found.append((node.lineno, node.slice))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            on_dict = isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault")
            if on_dict and isinstance(func.value, ast.Attribute) and func.value.attr == "__dict__":
                found.append((node.lineno, node.args[0]))
            elif (
                isinstance(func, ast.Name)
                and func.id in ("setattr", "getattr", "hasattr", "delattr")
                or isinstance(func, ast.Attribute)
                and func.attr == "__setattr__"
                and len(node.args) > 1
            ):
                found.append((node.lineno, node.args[1]))
    return found


def misplaced_names() -> list[str]:
    """Attribute names spelled as rope-extend's (``rope_extend...``) that do not come from ``hf.names``: a literal,
    or a constant defined in the module or imported from another. A local variable (``setattr(owner, key, value)``
    over a recorded list) and transformers' own names (``families.MSCALE_FUNCTION``) are not rope-extend's."""
    parsed = _parsed()
    constants = {name: _constants(tree) for name, (_, tree) in parsed.items()}
    out = []
    for name, (path, tree) in parsed.items():
        if name == NAMES or name in NOT_TRANSFORMERS:
            continue
        imported = _imported_names(name, path, tree)
        for line, key in _placed_names(name, path, tree):
            where = f"{path.relative_to(PACKAGE).as_posix()}:{line}"
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and "rope_extend" in key.value:
                out.append(f"{where} {key.value!r}")
            elif isinstance(key, ast.Name) and imported.get(key.id) != NAMES:
                source = imported.get(key.id, name)
                if "rope_extend" in constants.get(source, {}).get(key.id, ""):
                    out.append(f"{where} {key.id}")
    return out


def test_attribute_names_on_transformers_objects_come_from_hf_names():
    """Every name rope-extend places on a model, config, module or cache is listed in ``hf.names`` once (there were
    about a dozen, defined across eight modules); each module imports it from there."""
    assert misplaced_names() == []
    spelled = {
        f"{path.relative_to(PACKAGE).as_posix()}: {node.value}"
        for name, (path, tree) in _parsed().items()
        if name != NAMES and name not in NOT_TRANSFORMERS
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if node.value.startswith(("rope_extend_", "_rope_extend_")) and node.value not in NOT_ATTRIBUTES
    }
    assert spelled == set(), f"rope-extend attribute names spelled outside hf.names: {sorted(spelled)}"


def test_hf_names_lists_each_name_once():
    from rope_extend.hf import names

    values = [v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)]
    assert len(values) >= 15 and len(set(values)) == len(values)


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


# ------------------------------------------------------------------------------------------ evaluation tasks
# The task registry is the generic layer: it lists the built-in tasks by path and never imports one (as
# lm-evaluation-harness's registry never imports a model it lists). Each task is one module above it, holding its
# options dataclass, its harness (the function of the task's name) and its ``TASK``; so the imports point one way,
# from a task to the registry. (A task used to take up to five files, and its harness imported the task layer that
# imported it.)
TASK_REGISTRY = "rope_extend.evaluation.tasks"


def _in_registry(name: str) -> bool:
    return name == TASK_REGISTRY or name.startswith(TASK_REGISTRY + ".")


def task_layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every module the registry package reaches through its imports (lazy ones included) that imports the package
    back: a harness or a task imported by the layer its tasks register in."""
    seen: set[str] = set()
    todo = [name for name in graph if _in_registry(name)]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen and not _in_registry(target):
                seen.add(target)
                todo.append(target)
    return sorted(name for name in seen if any(_in_registry(t) for t in graph.get(name, ())))


def test_the_task_registry_imports_no_task_nor_harness():
    graph = import_graph()
    assert {name for name in graph if _in_registry(name)} == {TASK_REGISTRY, f"{TASK_REGISTRY}.base"}
    assert task_layer_breaks(graph) == []


def test_the_task_layer_rule_can_fail():
    """On the old layout (a task module in the registry package running its harness, which imports the options
    from the package) the rule names the harness."""
    old = {
        TASK_REGISTRY: {f"{TASK_REGISTRY}.base"},
        f"{TASK_REGISTRY}.base": {"rope_extend.registry"},
        f"{TASK_REGISTRY}.passkey": {f"{TASK_REGISTRY}.base", "rope_extend.evaluation.passkey"},
        "rope_extend.evaluation.passkey": {f"{TASK_REGISTRY}.options", "rope_extend.evaluation.retrieval"},
        "rope_extend.evaluation.retrieval": set(),
        "rope_extend.registry": set(),
    }
    assert task_layer_breaks(old) == ["rope_extend.evaluation.passkey"]


def test_each_built_in_task_is_one_module_with_its_options_and_harness():
    import importlib
    import inspect

    from rope_extend.evaluation.tasks.base import TASKS

    assert TASKS.names()[:4] == ["passkey", "niah", "perplexity", "ruler"]
    for name in ["passkey", "niah", "perplexity", "ruler"]:
        task = TASKS.get(name)
        module = importlib.import_module(task.run.__module__)
        assert not _in_registry(module.__name__), name
        assert module.TASK is task and task.options.__module__ == module.__name__, name
        harness = getattr(module, name)  # the harness a user calls: passkey(model, tokenizer, ..., options=...)
        assert inspect.isfunction(harness) and harness.__module__ == module.__name__, name
        assert "options" in inspect.signature(harness).parameters, name
        for part in (task.summarize, task.render, task.plot):
            assert part.__module__ == module.__name__, (name, part)


def _imports_tests(path: Path) -> list[str]:
    """The ``tests`` modules the script at ``path`` imports, at any depth of its code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        found += [n for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_eval_scripts_import_nothing_from_tests():
    """A benchmark script runs from a checkout or an installed copy without the test suite: helpers it shares
    with the tests live in the package or in eval/ (eval/tiny.py, eval/spm_bpe.py), never in tests/."""
    eval_dir = PACKAGE.parent / "eval"
    found = {str(p.relative_to(eval_dir)): _imports_tests(p) for p in sorted(eval_dir.rglob("*.py"))}
    assert found and {k: v for k, v in found.items() if v} == {}
    # the check can fail: it finds a test module's own imports from tests/, the top-level one and a lazy one
    found = _imports_tests(PACKAGE.parent / "tests" / "export" / "test_engines.py")
    assert "tests.export" in found and "tests.export.smollm2" in found
