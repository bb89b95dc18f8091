"""Everything that touches Redis data: connections, per-user stores, lanes, policies (and the
local fleet's state file, whose URL a connection falls back on)."""
