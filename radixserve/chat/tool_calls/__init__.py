"""Tool calls read back out of a model's text: one parser per format behind one interface
(`base.ToolCallParser`: `feed` as text streams in, `finish` at its end, `parse` for the
whole text at once), and the registry of the formats read under `tool_choice` auto
(`registry.PARSERS`)."""
