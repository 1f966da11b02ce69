"""The Phi-3 families' ``generate`` at ``original_max_position_embeddings`` (``hf.generation.install_recompute``).

Their ``prepare_inputs_for_generation`` drops the cache when the sequence first passes ``L``, to compute the prefix
again. transformers 5.17 (Phi-3, PhiMoE, Phi-4-multimodal) and 5.24's Phi-4-multimodal then feed only the token
the cache had not seen: the new cache holds that one token, and the token generated at the switch already parts
from uncached generation's (unpatched, on the tiny Phi-3 below: a logit gap of 0.59 at the switch). On a patched model
rope-extend asks again for the whole sequence, so cached greedy generation past ``L`` equals uncached generation
on every transformers, for every kind of method. These tests run on the installed transformers; ``.ci/run`` runs
them on 5.17 too (the core tests), where the recompute is what makes them pass.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from packaging.version import Version

import rope_extend
from rope_extend import UnsupportedModelError
from rope_extend.hf import cache_name, generation, names
from tests.tiny import tiny_model

L = 32  # the tiny Phi-3's original_max_position_embeddings: the switch is at L + 1 tokens
PROMPT, NEW = 24, 20  # the switch comes at the 9th new token
TOLERANCE = 1e-5  # float32 logits of order 1; measured at most 3e-7
FIXED_IN_524 = Version(transformers.__version__) >= Version("5.24")  # Phi-3's own switch feeds the whole prefix


def phi3(**overrides):
    return tiny_model("phi3", max_position_embeddings=4 * L, original_max_position_embeddings=L, **overrides)


def prompt(n: int = PROMPT, vocab: int = 512) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(1))


def cached_and_uncached(model, ids, **kwargs):
    """Greedy generation with the cache and without it: sequences and per-step logits."""
    g = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)
    g.update(output_logits=True, return_dict_in_generate=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the max-length reminder of the unpatched model
        return model.generate(ids, **g), model.generate(ids, use_cache=False, **g)


def gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))


def longrope_factors(n: int = 8) -> dict:
    return {"short_factor": [1.0 + 0.1 * i for i in range(n)], "long_factor": [2.0 + 0.5 * i for i in range(n)]}


METHODS = {
    "yarn": dict(factor=2.0),  # static frequencies
    "yarn+logn": dict(factor=2.0, logn=True),
    "dynamic": dict(factor=4.0),  # frequencies that follow the length: they change at the switch
    "dynamic_yarn": dict(factor=4.0),
    "longrope": dict(factor=4.0, **longrope_factors()),  # short factors up to L, long past it
    "self_extend": dict(factor=2.0),  # attention methods
    "rerope": {},
}


SWITCH = L + 1 - PROMPT  # the generation step whose forward sees L + 1 tokens: the family's recompute


@pytest.mark.parametrize("name", list(METHODS))
def test_cached_generation_past_L_equals_uncached_for_every_kind_of_method(name):
    """Greedy tokens equal throughout and logits equal up to and at the switch, where the prefix is computed
    again; past it too for the static and attention methods. A dynamic method's frequencies keep changing past the
    switch (on ``rotary.bucket``'s grid): there the cache keeper turns the cached keys and the earlier tokens keep
    their hidden states (docs/serving.md, the frozen reference), so later logits part by 9e-5 on either version,
    as on any family. Measured: at most 1.6e-7 elsewhere, the same numbers on 5.17 and 5.24."""
    model = phi3()
    rope_extend.patch(model, name.split("+")[0], **METHODS[name])
    cached, uncached = cached_and_uncached(model, prompt())
    assert cached.sequences.shape[1] == PROMPT + NEW > L + 1
    assert torch.equal(cached.sequences, uncached.sequences), name
    steps = SWITCH + 1 if name in ("dynamic", "dynamic_yarn") else NEW  # longrope changes at L only
    worst = max((a - b).abs().max().item() for a, b in zip(cached.logits[:steps], uncached.logits[:steps], strict=True))
    assert worst < TOLERANCE, name


def test_the_defect_it_mends_and_where_the_family_has_it():
    """Unpatched, the family's own switch is transformers': on 5.17 it computes the prefix from the last token only
    and the greedy tokens part (the switch is at the 9th new token); on 5.24 it is whole. Patched, whole on both.
    Told by what ``prepare_inputs_for_generation`` feeds: a cache that has seen ``L`` tokens, ``L + 1`` ids."""
    model = phi3()
    cached, uncached = cached_and_uncached(model, prompt())
    assert torch.equal(cached.sequences, uncached.sequences) == FIXED_IN_524
    assert (gap(cached, uncached) < TOLERANCE) == FIXED_IN_524

    from transformers import DynamicCache

    ids = prompt(L + 1)
    with torch.no_grad():
        seen = model(ids[:, :L], use_cache=True)
    cache = cache_name.returned(seen)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == L

    def fed(model) -> int:
        inputs = model.prepare_inputs_for_generation(ids, next_sequence_length=1, **cache_name.cache_kwargs(cache))
        assert cache_name.passed(inputs) is None  # dropped, on both versions: the prefix is computed again
        return inputs["input_ids"].shape[1]

    assert fed(model) == (L + 1 if FIXED_IN_524 else 1)
    rope_extend.patch(model, "yarn", factor=2.0)
    assert fed(model) == L + 1
    rope_extend.unpatch(model)  # transformers' own again
    assert names.PREPARE_INPUTS not in model.__dict__
    assert fed(model) == (L + 1 if FIXED_IN_524 else 1)


def test_beam_search_and_a_prompt_already_past_L():
    model = phi3()
    rope_extend.patch(model, "dynamic_yarn", factor=4.0)
    cached, uncached = cached_and_uncached(model, prompt(), num_beams=2)
    assert torch.equal(cached.sequences, uncached.sequences)
    cached, uncached = cached_and_uncached(model, prompt(L + 8))  # the cache is dropped before it saw any token
    assert torch.equal(cached.sequences, uncached.sequences) and gap(cached, uncached) < 1e-3  # dynamic: as above


@pytest.mark.parametrize("method", ["rerope", "yarn"])
def test_a_model_built_from_a_saved_patched_config_is_mended_too(tmp_path, method):
    """The other road (``hf.register``'s ``post_init``): a config of rope-extend's own type (``rerope``) runs its
    runtime; one of transformers' types (``yarn``) reloads as transformers' own, from the numbers rope-extend wrote
    (its config records the write). Both get the whole recompute; a model rope-extend never touched does not."""
    model = phi3()
    rope_extend.patch(model, method, **({"factor": 2.0} if method == "yarn" else {}))
    model.save_pretrained(tmp_path)
    built = type(model).from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert names.PREPARE_INPUTS in built.__dict__
    cached, uncached = cached_and_uncached(built, prompt())
    assert torch.equal(cached.sequences, uncached.sequences) and gap(cached, uncached) < TOLERANCE
    assert names.PREPARE_INPUTS not in phi3().__dict__


@pytest.mark.parametrize("family", ["phimoe", "phi4_multimodal"])
def test_the_other_families_of_the_rule(family):
    """PhiMoE and Phi-4-multimodal drop the cache in the same words; 5.24's Phi-4-multimodal still feeds the last
    token only (its override does not reset ``next_sequence_length``): unpatched its greedy tokens part from the
    uncached ones on 5.24 too; patched they are equal."""
    from tests.families.tiny import build

    model = build(family)
    model.config.__dict__["original_max_position_embeddings"] = L  # the tiny configs leave it out, or at 4096
    ids = prompt(vocab=model.config.vocab_size)
    rope_extend.patch(model, "yarn", factor=2.0)
    cached, uncached = cached_and_uncached(model, ids)
    assert torch.equal(cached.sequences, uncached.sequences) and gap(cached, uncached) < TOLERANCE
    rope_extend.unpatch(model)
    cached, uncached = cached_and_uncached(model, ids)
    assert torch.equal(cached.sequences, uncached.sequences) == (FIXED_IN_524 and family == "phimoe")


def test_a_switch_that_stays_partial_is_refused_naming_the_version():
    """A family whose code feeds the last token even when asked for the whole sequence: refused at the switch,
    in one line naming the transformers version and the fix, rather than generating from a one-token cache."""

    class Partial(type(phi3())):
        def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
            inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
            if cache_name.passed(inputs) is None and inputs.get("input_ids") is not None:
                inputs["input_ids"] = inputs["input_ids"][:, -1:]  # what 5.17 does, whatever it is asked
            return inputs

    model = Partial(phi3().config).eval()
    rope_extend.patch(model, "yarn", factor=2.0)
    with pytest.raises(UnsupportedModelError) as err:
        cached_and_uncached(model, prompt())
    assert str(err.value) == (
        f"Partial.generate replaces the cache by a new one once the sequence passes "
        f"config.original_max_position_embeddings ({L}) tokens, to recompute it for LongRoPE, and with transformers "
        f"{transformers.__version__} computes it from the last 1 of the {L + 1} tokens only, which would make every "
        "later token wrong: upgrade transformers (5.24 recomputes the whole prefix), or generate with use_cache=False"
    )


def test_the_probe_configure_asks_finds_the_defect_where_generate_has_it():
    """``generation.own_switch_is_partial`` asks the family's own ``prepare_inputs_for_generation`` what the test
    above asks it (``fed``), on a meta-device copy with one layer: the last token only on 5.17 (all three families)
    and for 5.24's Phi-4-multimodal; whole for 5.24's Phi-3 and PhiMoE; never for a family that keeps its cache."""
    from tests.families.tiny import tiny_config as family_config
    from tests.tiny import tiny_config

    assert generation.own_switch_is_partial(phi3().config) is (not FIXED_IN_524)
    assert generation.own_switch_is_partial(family_config("phimoe")) is (not FIXED_IN_524)
    assert generation.own_switch_is_partial(family_config("phi4_multimodal")) is True
    assert generation.own_switch_is_partial(tiny_config("llama")) is False


def _configure(tmp_path, capsys, method: str, *extra: str):
    from rope_extend.cli import main

    source, out = tmp_path / "model", tmp_path / method
    if not source.exists():
        phi3().save_pretrained(source)
    capsys.readouterr()
    assert main(["configure", str(source), "--method", method, *extra, "--out", str(out)]) == 0
    return out, capsys.readouterr().err


PLAIN = """
import sys, torch, warnings
from transformers import AutoModelForCausalLM
warnings.simplefilter("ignore")
try:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
except Exception as exc:
    print("refused:", type(exc).__name__)
    raise SystemExit
ids = torch.randint(3, 512, (1, int(sys.argv[2])), generator=torch.Generator().manual_seed(1))
g = dict(max_new_tokens=int(sys.argv[3]), min_new_tokens=int(sys.argv[3]), do_sample=False, pad_token_id=0)
with torch.no_grad():
    same = torch.equal(model.generate(ids, **g), model.generate(ids, use_cache=False, **g))
assert "rope_extend" not in sys.modules
print("equal" if same else "parted")
"""


def _without_rope_extend(folder) -> str:
    """What plain transformers does with ``folder`` in a process that never imports rope_extend."""
    import subprocess
    import sys

    args = [sys.executable, "-c", PLAIN, str(folder), str(PROMPT), str(NEW)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_configure_warns_where_the_folder_would_run_as_plain_transformers(tmp_path, capsys):
    """A Phi-3 configured with ``longrope`` (the one type its config class takes without rope-extend) loads
    without rope-extend, and then generates as transformers does: on 5.17 from a one-token cache once past ``L``,
    shown in a process that never imports rope_extend (cached and uncached greedy tokens part). configure says so
    in one line where the probe finds the defect; it is silent on 5.24 (the whole prefix is recomputed), and for
    ``yarn`` (Phi-3's config class refuses it as it loads: nothing runs) and rope-extend's own ``rerope`` alike."""
    out, err = _configure(tmp_path, capsys, "longrope", "--factor", "4", *_params(longrope_factors()))
    warning = (
        f"rope-extend: warning: {out} loads without rope-extend (a rope type of transformers' own), and there "
        f"transformers {transformers.__version__}'s phi3 generate recomputes the cache from the last token only once "
        f"a sequence passes original_max_position_embeddings ({L}) tokens, making every later token wrong: import "
        "rope_extend before loading it, or generate with use_cache=False, or upgrade transformers (5.24 mends "
        "Phi-3 and Phi-3.5-MoE; docs/serving.md)"
    )
    assert err.strip() == ("" if FIXED_IN_524 else warning)
    assert _without_rope_extend(out) == ("equal" if FIXED_IN_524 else "parted")  # warned exactly where they part
    built = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # what the warning advises: here, with
    cached, uncached = cached_and_uncached(built, prompt())  # rope_extend imported, the switch is made whole
    assert names.PREPARE_INPUTS in built.__dict__ and torch.equal(cached.sequences, uncached.sequences)
    out, err = _configure(tmp_path, capsys, "yarn", "--factor", "2")
    assert err == "" and _without_rope_extend(out) == "refused: KeyError"
    assert _configure(tmp_path, capsys, "rerope")[1] == ""


def _params(params: dict) -> list[str]:
    return [a for k, v in params.items() for a in ("--param", f"{k}={json.dumps(v)}")]
