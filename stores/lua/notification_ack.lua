-- notification_ack: ack ready-stream notifications, only those still pending under the caller.
--
-- XACK acks an entry whoever holds it. A notification the caller was delivered may since have
-- been reclaimed (XAUTOCLAIM) by another worker, for which it now carries the duty of the
-- user's backlog; acking it then would leave that duty with nobody. So an
-- entry is acked here only while it is pending under the caller's own consumer.
--
-- KEYS[1]  fleet:{T}:ready      the tier's ready stream
-- ARGV[1]  consumer group name  (protocol.keys.GROUP)
-- ARGV[2]  the caller's consumer name (its worker id)
-- ARGV[3..] notification ids
--
-- The worker batches its jobs' acks: one call acks the ids of many users (each id was
-- found ackable by its own job, under its own user's lane), with one XACK for all that pass.
--
-- Returns the number of notifications acked.
local ours = {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #entry == 1 and entry[1][2] == ARGV[2] then
    ours[#ours + 1] = ARGV[i]
  end
end
if #ours == 0 then
  return 0
end
return redis.call('XACK', KEYS[1], ARGV[1], (table.unpack or unpack)(ours))
