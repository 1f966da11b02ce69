"""Every attribute and hook name rope-extend places on transformers objects (models, configs, modules, caches).

One list, so that a reader sees at once what a patched model carries, and a name is never spelled twice
(``tests/test_structure.py`` checks that every name placed on a transformers object comes from here).
"""

from __future__ import annotations

PATCH_STATE = "_rope_extend_state"  # on the model ``patch`` patched: its ``hf.installed.Installed``
