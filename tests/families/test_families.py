"""The sweep: every RoPE family of the installed transformers' registry x every method, each cell exact or refused
(``test_frequency_families.frequency_cell``, ``test_attention_families.attention_cell``), and equal to the committed
snapshot of that transformers version (``snapshot``), so that no cell changes quietly: exact to refused, one reason
to another, a family that stops building. Record an intended change with ``python -m tests.families.table --update``.

Each family is built once (a module-scoped fixture) and every method runs on it through ``rope_extend.unpatch``;
each cell checks that the logits after ``unpatch`` are bit-identical to the unpatched model's. A family is skipped
only for a ``not buildable`` reason given in advance (``tiny.Unbuildable``) or recorded in the snapshot.
"""

from __future__ import annotations

import pytest
import transformers

from tests.families import snapshot
from tests.families.sweep import FREQUENCY, METHODS, one_thread, open_family, run
from tests.families.tiny import rope_families

FAMILIES = rope_families()
RECORDED = snapshot.load()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    family = open_family(request.param, tmp_path_factory.mktemp(request.param))
    yield family
    family.close()


@pytest.mark.families
@pytest.mark.parametrize("method", METHODS)
def test_cell(family, method):
    now = run(family, method)
    recorded = snapshot.cell(RECORDED, family.name, method)
    if RECORDED is not None:  # without a snapshot, test_snapshot_of_the_installed_transformers fails once
        assert now == recorded, snapshot.changed(family.name, method, recorded, now)
    if now.startswith(snapshot.UNBUILT):
        if not (family.explicit or now == recorded):
            pytest.fail(f"{family.name} x {method}: {now}; record it with `{snapshot.UPDATE}` if that is intended")
        pytest.skip(f"{family.name}: {now}")
    if method in FREQUENCY and now == snapshot.EXACT and RECORDED is not None:
        # (d) runs where a plain save and reload reproduces the tiny model: which families those are is pinned too
        differs = family.name in RECORDED["reload_differs"]
        assert family.reproducible != differs, (
            f"{family.name}: a plain save and reload of its tiny model {'now' if differs else 'no longer'} gives "
            f"the built model's logits, so check (d) {'runs' if differs else 'cannot run'}; record it with "
            f"`{snapshot.UPDATE}`"
        )


@pytest.mark.families
def test_snapshot_of_the_installed_transformers():
    """A transformers version without a snapshot (an upgrade) fails here once, with what to do; its cells are still
    checked exact or refused. A snapshot's families are the registry's: one that left it fails here too."""
    have = ", ".join(snapshot.versions())
    assert RECORDED is not None, (
        f"transformers {transformers.__version__} has no families snapshot (tests/families/snapshots has {have}): "
        f"record one with `{snapshot.UPDATE}`; it prints how its cells differ from the nearest recorded version's. "
        "Review that, then commit the snapshot with docs/families.md"
    )
    gone = sorted(set(RECORDED["families"]) - set(FAMILIES))
    assert not gone, f"{gone} are in {snapshot.path().name} but not in the registry: `{snapshot.UPDATE}` drops them"
    assert RECORDED["methods"] == list(METHODS), f"the methods changed: `{snapshot.UPDATE}`"
