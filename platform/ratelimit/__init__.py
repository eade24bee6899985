"""Per-API-key request and token rate limits."""
