"""OpenAI's Batch API: /v1/files holds a tenant's JSONL request files, /v1/batches runs them.

- files.py: the file store (blobs in the adapter storage's content-addressed layout, rows in the database)
- validation.py: an input file's lines checked before anything runs
- repository.py: batches and their lines in the database (claims, leases, results, counts)
- execution.py: one line through the same request pipeline as an online request, as background work
- runner.py / worker.py: the asyncio worker in each API server that claims batches by lease and runs them
"""
