"""Chat apart from HTTP: the model's chat template (rendered in a bounded pool, `templates`;
the prompt of a request, `prompt`; its role markers for the DSL, `role_template`), what a
request's tools and `tool_choice` ask of the prompt and the output (`tool_plan`), and the
tool calls read back out of the model's text, one parser per format (`tool_calls`).

Nothing here knows of a web framework: failures are `errors.ChatError`, which the HTTP
layer answers as it answers its own errors."""
