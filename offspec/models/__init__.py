"""Where models come from: sources, the default pair, conversion into the cache, loading."""
