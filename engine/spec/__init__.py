"""Speculative decoding: proposers of draft tokens, the policy that decides where to draft, the verifier."""
