"""Rewrites of a JSON schema that keep its language exactly and that the backends can then enforce.

`oneOf` means "exactly one branch": a backend that only knows `anyOf` ("at
least one") would be looser. When every two branches are provably disjoint
(no instance can match both), the two are the same language, and `oneOf` is
rewritten as `anyOf`; the keywords beside the `oneOf` narrow the instances in
question, so they count in the proof. The proof is conservative (`schema_disjoint`: distinct
types or constants, a finite set outside the other branch, a required key
whose schemas are disjoint, a closed object, pattern alphabets); anything it
cannot prove stays `oneOf` (and a backend that cannot enforce it refuses it).
"""

from __future__ import annotations

import copy
from itertools import combinations
from typing import Any

from loraplex.grammar.schema.disjoint import Disjointness
from loraplex.grammar.schema.walk import subschemas

_MAX_BRANCHES = 64


def with_disjoint_one_of_as_any_of(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with each provably disjoint `oneOf` written as `anyOf`."""
    if not any(isinstance(node, dict) and "oneOf" in node for _, node, _ in subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    proofs = Disjointness(schema)
    for _, node, _ in list(subschemas(schema)):
        if not isinstance(node, dict) or "anyOf" in node or not isinstance(node.get("oneOf"), list):
            continue
        branches = node["oneOf"]
        if len(branches) > _MAX_BRANCHES:
            continue
        # Instances that fail the keywords beside the oneOf fail the node anyway: disjoint among the others is enough.
        context = {k: v for k, v in node.items() if k != "oneOf"}
        if all(proofs.disjoint(a, b, context=context) for a, b in combinations(branches, 2)):
            node["anyOf"] = node.pop("oneOf")
        elif len(branches) > 1 and all(proofs.object_only(b) for b in branches) and all(
                proofs.disjoint(a, b, among_objects=True, context=context) for a, b in combinations(branches, 2)):
            # Every other value matches every branch, so more than one: only objects can match exactly one.
            node["anyOf"] = node.pop("oneOf")
            node["allOf"] = [*node.get("allOf", []), {"type": "object"}]
    return schema
