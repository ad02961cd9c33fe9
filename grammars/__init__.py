"""Grammar constraints (JSON schema, regex, choice, CFG) as matchers with explicit advance / rollback.

Not implemented yet: `decoders.generate(..., grammar=...)` says so with a clear error.
"""
