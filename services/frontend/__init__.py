"""The OpenAI-compatible HTTP frontend (FastAPI): see app.py and docs/api.md."""
