-- notification_touch: a lane holder keeps its notifications' idle time low, so no other worker
-- reclaims them (XAUTOCLAIM takes entries idle past reclaim_idle_ms), but only those still
-- pending under its own consumer.
--
-- XCLAIM with min-idle 0 takes an entry from whoever holds it. A notification another worker
-- reclaimed carries that worker's duty for the user now (it may hold the user's lane); taken
-- back, a later ack of the old holder's would leave the duty with nobody (a worker paused past
-- its lease comes back, renews, would take back the reclaimed notifications of lanes it has
-- lost, then ack them on its busy acquire).
--
-- KEYS[1]  fleet:{T}:ready      the tier's ready stream
-- ARGV[1]  consumer group name  (protocol.keys.GROUP)
-- ARGV[2]  the caller's consumer name (its worker id)
-- ARGV[3..] notification ids
--
-- Returns the number of notifications touched (claimed again by the caller, idle reset).
local touched = 0
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #entry == 1 and entry[1][2] == ARGV[2] then
    touched = touched + #redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return touched
