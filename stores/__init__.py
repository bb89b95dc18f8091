"""Everything that touches Redis data: connections, per-user stores, lanes, policies."""
