"""The API server: HTTP app, OpenAI protocol, SSE, auth and errors, tokenizer and detokenizer, metrics,
the engine client and the data-parallel router. It sits above the engine and talks to it only over IPC."""
