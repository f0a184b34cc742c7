"""The chat model kb talks to (KB_CHAT_MODEL on OPENAI_BASE_URL): for Q&A cards, answers, HyDE and the LLM
reranker. Any OpenAI-compatible endpoint; the openai client retries 408/409/429/5xx and timeouts with
exponential backoff and honours Retry-After, as for embeddings."""

from __future__ import annotations

from pipelines.settings import Settings


class ChatNotConfigured(RuntimeError):
    pass


def openai_client(settings: Settings):
    """The client for OPENAI_BASE_URL, chat and embeddings alike (its key, retries and timeout)."""
    from openai import OpenAI

    return OpenAI(api_key=settings.openai_api_key or "not-needed", base_url=settings.openai_base_url,
                  max_retries=settings.openai_max_retries, timeout=settings.openai_timeout_s)


def complete(client, model: str, prompt: str) -> str:
    """One user message, temperature 0; the reply's text ("" when the model returns none)."""
    reply = client.chat.completions.create(model=model, temperature=0, messages=[{"role": "user", "content": prompt}])
    return reply.choices[0].message.content or ""
