"""trioserve: an OpenAI-compatible LLM serving engine on Trio."""
