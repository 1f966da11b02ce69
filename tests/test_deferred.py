"""rope_extend.deferred: registration when transformers' rope utilities load, and lazy package exports."""

import json
import subprocess
import sys
import textwrap

import pytest

from rope_extend.deferred import ReadyFinder


def _python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_rope_extend_imports_neither_torch_nor_transformers():
    got = _python("""
        import json, sys
        import rope_extend
        print(json.dumps({m: m in sys.modules for m in ("torch", "transformers")}))
    """)
    assert got == {"torch": False, "transformers": False}


def test_registration_happens_when_transformers_loads_its_rope_utilities():
    got = _python("""
        import json, sys
        import rope_extend
        before = "transformers.modeling_rope_utils" in sys.modules
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        import transformers.modeling_rope_utils as mru
        kw = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64, vocab_size=100)
        rope = {"rope_type": "ntk_by_parts", "factor": 4.0, "rope_theta": 10000.0,
                "original_max_position_embeddings": 128}
        ok = LlamaConfig(**kw, rope_parameters=rope).rope_parameters["rope_type"]
        try:
            LlamaConfig(**kw, rope_parameters={**rope, "factor": 0.5})
            bad = "accepted"
        except Exception as exc:
            bad = type(exc).__name__
        finders = [type(f).__name__ for f in sys.meta_path]
        loader = type(mru.__loader__).__name__
        print(json.dumps({"before": before, "types": sorted(t for t in ("ntk", "dynamic_yarn", "ntk_by_parts")
                          if t in ROPE_INIT_FUNCTIONS), "ok": ok, "bad": bad, "watching": "ReadyFinder" in finders,
                          "loader": loader}))
    """)
    assert got["before"] is False
    assert got["types"] == ["dynamic_yarn", "ntk", "ntk_by_parts"]
    assert got["ok"] == "ntk_by_parts" and got["bad"] != "accepted"
    assert got["watching"] is False  # the finder removed itself
    assert got["loader"] == "SourceFileLoader"  # the module keeps transformers' own loader


def test_registration_is_immediate_when_transformers_came_first():
    got = _python("""
        import json, sys
        import transformers.modeling_rope_utils as mru
        import rope_extend
        print(json.dumps({"ntk": "ntk" in mru.ROPE_INIT_FUNCTIONS,
                          "watching": any(type(f).__name__ == "ReadyFinder" for f in sys.meta_path)}))
    """)
    assert got == {"ntk": True, "watching": False}


def test_the_command_line_parser_does_not_import_transformers():
    got = _python("""
        import json, sys
        from rope_extend.cli import build_parser
        build_parser().format_help()
        print(json.dumps({"transformers": "transformers" in sys.modules}))
    """)
    assert got == {"transformers": False}


def test_public_names_and_their_modules():
    """``rope_extend.patch`` is the function (its module is ``rope_extend.patching``), ``rope_extend.methods`` the
    package (the listing function is ``method_names``); the evaluation functions keep the names of their
    submodules, whichever is imported first."""
    got = _python("""
        import json, types
        import rope_extend.patching, rope_extend.methods.registry, rope_extend.evaluation.passkey
        import rope_extend, rope_extend.evaluation as ev
        from rope_extend.evaluation import passkey, ruler
        from rope_extend import patch, patched, unpatch, methods
        module = lambda m: isinstance(m, types.ModuleType)
        print(json.dumps({
            "functions": [callable(f) and not module(f)
                          for f in (rope_extend.patch, patch, patched, unpatch, rope_extend.method_names,
                                    ev.passkey, passkey, ruler, ev.perplexity)],
            "modules": [module(m) for m in (rope_extend.patching, rope_extend.methods, methods)],
            "patch": rope_extend.patch is rope_extend.patching.patch,
            "registry": rope_extend.methods.registry.names is rope_extend.method_names,
            "methods": rope_extend.method_names()[:2],
            "submodule": type(rope_extend.hf).__name__ if hasattr(rope_extend, "hf") else None,
            "dir": all(n in dir(rope_extend) for n in rope_extend.__all__),
            "all": "methods" in rope_extend.__all__,
        }))
    """)
    assert got["functions"] == [True] * 9 and got["modules"] == [True] * 3
    assert got["patch"] is True and got["registry"] is True
    assert got["methods"] == ["linear", "ntk"]
    assert got["submodule"] == "module" and got["dir"] is True and got["all"] is False
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        import rope_extend

        rope_extend.nonexistent  # noqa: B018


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package ``fakepkg``: its ``__init__`` imports ``outer``, which imports ``rope`` and then sets DONE."""
    root = tmp_path / "fakepkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "rope.py").write_text("VALUE = 1\n")
    (root / "outer.py").write_text("from . import rope\nDONE = True\n")
    (root / "broken.py").write_text("from . import rope\nraise RuntimeError('broken module')\n")
    (root / "other.py").write_text("X = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakepkg"
    for name in [m for m in sys.modules if m == "fakepkg" or m.startswith("fakepkg.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, ReadyFinder)]


def _seen_after_outer(calls):
    def action():
        outer = sys.modules.get("fakepkg.outer")
        calls.append(getattr(outer, "DONE", None))

    return action


def test_finder_acts_once_after_the_outermost_import_finished(fake_package):
    calls = []
    finder = ReadyFinder(_seen_after_outer(calls), watched="fakepkg", trigger="fakepkg.rope")
    sys.meta_path.insert(0, finder)
    import fakepkg.other  # the trigger is not loaded: nothing happens

    assert calls == [] and finder in sys.meta_path
    import fakepkg.outer  # rope loads inside outer: the action waits until outer has finished

    assert calls == [True] and finder not in sys.meta_path and finder.depth == 0
    del sys.modules["fakepkg.other"]
    import fakepkg.other  # noqa: F401

    assert calls == [True]
    assert type(sys.modules["fakepkg.outer"].__loader__).__name__ == "SourceFileLoader"


def test_finder_does_not_act_on_a_failed_import(fake_package):
    calls = []
    finder = ReadyFinder(lambda: calls.append(1), watched="fakepkg", trigger="fakepkg.rope")
    sys.meta_path.insert(0, finder)
    with pytest.raises(RuntimeError, match="broken module"):
        import fakepkg.broken
    assert finder.depth == 0
    # rope itself finished inside the failed import; the next import that settles acts
    assert calls == []
    import fakepkg.other  # noqa: F401

    assert calls == [1]
