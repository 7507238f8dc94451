"""Chat apart from HTTP: the model's chat template (rendered in a bounded pool), what a
request's tools and `tool_choice` ask of the prompt and the output (`tool_plan`), and the
tool calls read back out of the model's text, one parser per format (`tool_calls`).

Nothing here knows of a web framework: failures are `errors.ChatError`, which the HTTP
layer answers as it answers its own errors."""
