"""The platform's tables (tenants, API keys) and database plumbing shared by all domains."""
