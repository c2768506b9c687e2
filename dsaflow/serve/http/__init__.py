"""`dsaflow serve`: the OpenAI-compatible HTTP front end that runs in the parent process (docs/serving.md)."""
