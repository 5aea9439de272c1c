"""Checks: the start-up self-check, the shrunk-twin check of an unannounced architecture, and the overlap audit."""
