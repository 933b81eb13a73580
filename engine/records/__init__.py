"""Resource records: what a run used and produced, kept in a SQLite history (no Qt)."""
