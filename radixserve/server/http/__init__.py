"""The HTTP API: SGLang's native API, the OpenAI-compatible API and Prometheus metrics,
served by uvicorn in a thread of the front door's process, which it calls in-process
(`server.HttpServer`)."""
