"""The OpenAI-compatible surface: request schemas, request preparation, generation, response shaping."""
