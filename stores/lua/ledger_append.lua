-- ledger_append: append an event to the scaling ledger, only while the caller leads.
-- The commander appends *before* it acts: a deposed leader's append fails, so it never acts.
--
-- KEYS[1]  {fleet:events}:leader   must hold ARGV[1]
-- KEYS[2]  fleet:events            the ledger stream
-- ARGV[1]  "<commander>|<epoch>"
-- ARGV[2]  approximate max length of the ledger
-- ARGV[3]  the event (msgpack LedgerEvent), stored as field "m"
-- ARGV[4]  the tier, stored as field "tier" (so readers can filter without decoding)
--
-- Returns the new entry id, or an error 'FENCED ...' if the caller no longer leads.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED not the leader')
end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[3], 'tier', ARGV[4])
