"""The HTTP front door: SGLang's native API, the OpenAI-compatible API and Prometheus
metrics, served by uvicorn in a thread of the tokenizer process over one RPC client
(`server.HttpServer`)."""
