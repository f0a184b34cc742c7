"""Models kb calls: the local and OpenAI-compatible embedders, token counting, the chat model."""
