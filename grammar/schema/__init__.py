"""JSON-schema passes: rewrites that keep a schema's language and put it in words the backends enforce.

`passes.SCHEMA_PASSES` is the one list, in order; the proofs and walks they use
(`walk`, `negate`, `finite`, `subset`, `disjoint`) live beside them.
"""
