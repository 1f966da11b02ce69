"""rope_extend.hf.transformers_changes: every change to transformers made by install and put back by uninstall,
the very objects transformers held before."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers
from transformers import modeling_rope_utils as mru
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface, PreTrainedModel

import rope_extend
from rope_extend.hf import transformers_changes
from rope_extend.methods import registry
from tests.tiny import tiny_config, tiny_model

LONGROPE_ONLY = [transformers.Phi3Config, transformers.Phi4MultimodalConfig]


def _state() -> dict[str, dict]:
    """Everything the changes touch, as ``{place: {key: object}}``."""
    return {
        "ROPE_INIT_FUNCTIONS": dict(mru.ROPE_INIT_FUNCTIONS),
        "RotaryEmbeddingConfigMixin": dict(vars(mru.RotaryEmbeddingConfigMixin)),
        "PreTrainedModel": dict(vars(PreTrainedModel)),
        "AttentionInterface": dict(AttentionInterface._global_mapping),
        "AttentionMaskInterface": dict(AttentionMaskInterface._global_mapping),
        "listeners": dict(enumerate(registry.METHODS._listeners)),
        **{cls.__name__: dict(vars(cls)) for cls in LONGROPE_ONLY},
    }


def _differences(a: dict[str, dict], b: dict[str, dict]) -> list[str]:
    """Where ``a`` and ``b`` differ: a key in one only, or a key whose objects are not the same object."""
    out = []
    for place, here in a.items():
        there = b[place]
        out += [f"{place}.{k}" for k in here.keys() | there.keys() if here.get(k, None) is not there.get(k, None)]
    return sorted(out)


@pytest.fixture
def reinstalled():
    yield
    transformers_changes.install()  # whatever the test did, the suite goes on with rope-extend installed
    assert transformers_changes.installed()


def test_uninstall_puts_back_the_very_objects_and_install_makes_the_same_changes_again(reinstalled):
    assert transformers_changes.installed()
    changed = _state()
    transformers_changes.uninstall()
    original = _state()
    # every change is gone
    assert {"ntk", "dynamic_yarn", "proportional_yarn"}.isdisjoint(original["ROPE_INIT_FUNCTIONS"])
    assert not hasattr(PreTrainedModel.post_init, "__wrapped__")
    assert not hasattr(mru.RotaryEmbeddingConfigMixin._check_received_keys, "__wrapped__")
    assert "rope_extend" not in original["AttentionInterface"]
    assert "rope_extend" not in original["AttentionMaskInterface"]
    assert all(not hasattr(cls.validate_rope, "__wrapped__") for cls in LONGROPE_ONLY)
    assert original["listeners"] == {}
    # and only those: what transformers owns is the same object in both states
    touched = set(_differences(changed, original))
    assert "PreTrainedModel.post_init" in touched and "Phi3Config.validate_rope" in touched
    assert all(changed[p][k] is original[p][k] for p in original for k in original[p] if f"{p}.{k}" not in touched)

    transformers_changes.uninstall()  # idempotent
    assert _differences(_state(), original) == []

    transformers_changes.install()
    again = _state()
    assert {p: set(s) for p, s in again.items()} == {p: set(s) for p, s in changed.items()}
    assert mru.ROPE_INIT_FUNCTIONS["ntk"] is changed["ROPE_INIT_FUNCTIONS"]["ntk"]
    transformers_changes.install()  # idempotent
    assert _differences(_state(), again) == []

    transformers_changes.uninstall()
    assert _differences(_state(), original) == []  # the originals come back, identity-equal, a second time


def test_after_a_round_trip_configs_and_patches_work_as_before(reinstalled):
    ids = torch.randint(3, 500, (1, 300))
    transformers_changes.uninstall()
    transformers_changes.install()
    rope = {"rope_type": "dynamic_yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256}
    built = transformers.LlamaForCausalLM(tiny_config(rope_parameters=rope))
    assert "forward" in built.model.rotary_emb.__dict__  # post_init attached the rotary runtime
    model = tiny_model()
    with torch.no_grad():
        plain = model(ids).logits
        rope_extend.patch(model, "yarn", factor=2)
        assert (model(ids).logits - plain).abs().max() > 1e-4
        rope_extend.unpatch(model)
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)


def test_uninstall_before_transformers_loads_disarms_the_finder():
    code = """
        import json, sys
        import rope_extend
        from rope_extend.hf import transformers_changes
        armed = any(type(f).__name__ == "ReadyFinder" for f in sys.meta_path)
        transformers_changes.uninstall()
        import transformers.modeling_rope_utils as mru
        print(json.dumps({"armed": armed, "finders": [type(f).__name__ for f in sys.meta_path].count("ReadyFinder"),
                          "ntk": "ntk" in mru.ROPE_INIT_FUNCTIONS, "installed": transformers_changes.installed()}))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"armed": True, "finders": 0, "ntk": False, "installed": False}


@pytest.mark.parametrize(
    ("module", "category"),
    [
        ("transformers.modeling_utils", FutureWarning),
        ("rope_extend.hf.rotary", DeprecationWarning),
        ("rope_extend.hf.rotary", FutureWarning),
        ("tests.test_patch", DeprecationWarning),
        ("tests.test_patch", FutureWarning),
    ],
)
def test_a_deprecation_met_by_our_code_is_an_error_in_the_tests(module, category):
    """pyproject's filterwarnings: a deprecation met by our code or tests, or a FutureWarning transformers raises
    about its own API, fails the test."""
    with pytest.raises(category):
        warnings.warn_explicit("old API", category, "f.py", 1, module=module)


def test_other_libraries_deprecations_among_themselves_stay_quiet():
    warnings.warn_explicit("old API", DeprecationWarning, "f.py", 1, module="torch.nn.modules.module")
