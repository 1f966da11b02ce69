"""The combination matrix: every method x cache x generation mode x attention implementation x model shape.

``cells`` generates the cells (from rope-extend's registry and transformers' list of caches) and states, in one
place, the rules for combinations that do not exist or are not run; ``run`` runs one cell against the uncached
explicit reference; ``test_matrix`` asserts every cell (pytest marker ``matrix``, its own CI step); ``table``
writes docs/combinations.md from the same outcomes.
"""
