"""Durable state: the lifecycles (jobs, slices), the typed events, and the SQLite store."""
