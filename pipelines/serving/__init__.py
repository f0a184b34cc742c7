"""Serving: the HTTP API, the search console, API keys and callers' groups."""
