"""Checkpoint I/O: model folders read one decoder layer at a time, GGUF files, atomic writes, fingerprints by content."""
