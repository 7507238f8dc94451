"""What calls answer: typed generate results and their SGLang dict shape (`generate`),
and the one error type every surface reports failures with (`errors`).

Only msgspec and the standard library are imported here, so the wire schema
(`radixserve.messages`) can carry these structs."""
