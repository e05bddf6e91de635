"""The on-disk weight store: cache entries and their packed per-layer files."""
