"""Grammar backends (llguidance, xgrammar) behind one Protocol, reached only through `registry`."""
