"""The `loraplex` command line (Typer)."""
