"""OpenAI's Responses API on the chat pipeline: stored, chained responses continuing on pinned KV."""
