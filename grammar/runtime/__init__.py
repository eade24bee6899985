"""What runs per token: matchers over a backend grammar, the close near the budget, checked uniqueness, the
reasoning gate."""
