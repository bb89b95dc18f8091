-- notification_ack: ack ready-stream notifications, only those still pending under the caller.
--
-- XACK acks an entry whoever holds it. A notification the caller was delivered may since have
-- been reclaimed (XAUTOCLAIM) by another worker, for which it now carries the duty of the
-- user's backlog; acking it then would leave that duty with nobody (issue 8, hole 1). So an
-- entry is acked here only while it is pending under the caller's own consumer.
--
-- KEYS[1]  fleet:{T}:ready      the tier's ready stream
-- ARGV[1]  consumer group name  (protocol.keys.GROUP)
-- ARGV[2]  the caller's consumer name (its worker id)
-- ARGV[3..] notification ids
--
-- Returns the number of notifications acked.
local acked = 0
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #entry == 1 and entry[1][2] == ARGV[2] then
    acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  end
end
return acked
