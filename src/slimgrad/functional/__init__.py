"""Functional forms (imports restored once every family has landed)."""
