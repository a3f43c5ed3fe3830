"""Drop-in modules (imports restored once every family has landed)."""
