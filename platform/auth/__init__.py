"""API keys, scopes and the tenant/key data functions."""
