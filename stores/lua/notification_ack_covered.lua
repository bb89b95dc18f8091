-- notification_ack_covered: a job that found its user's lane busy acks its notifications for
-- the user, relying on the holder to carry the user's duty, only while that is true: the
-- holder still has a notification for the user pending under its own consumer.
--
-- The holder's pending notification is what brings the user back if the holder dies mid-turn.
-- A commander's takeover acks a worker's notifications (after posting a fresh one) and deletes
-- its consumer; a worker that was only slow, not dead, may then take the lane again and hold it
-- with nothing pending (a sweep after a long outage can take a live worker for dead: the
-- takeover's fresh notification meets the re-taken lane and would be acked here; if the
-- holder's job then fails, the user's last turns wait with no lane and no pending
-- notification). Then nothing is acked: the caller's stay pending, to be reclaimed once idle.
--
-- KEYS[1]  fleet:{T}:ready      the tier's ready stream
-- ARGV[1]  consumer group name  (protocol.keys.GROUP)
-- ARGV[2]  the caller's consumer name (its worker id)
-- ARGV[3]  the holder's consumer name (the worker id in the lane's "<worker>|<token>")
-- ARGV[4]  the user
-- ARGV[5..] the caller's notification ids
--
-- Returns the number acked (only ids pending under the caller, as notification_ack), or -1 if
-- the holder has no pending notification for the user (none acked). At most 1,000 of the
-- holder's pending entries are looked at: beyond that the answer is -1, which is safe.
local carried = false
for _, row in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000, ARGV[3])) do
  local entry = redis.call('XRANGE', KEYS[1], row[1], row[1])
  if #entry == 1 then
    local fields = entry[1][2]
    for i = 1, #fields - 1, 2 do
      if fields[i] == 'user' and fields[i + 1] == ARGV[4] then
        carried = true
        break
      end
    end
  end
  if carried then
    break
  end
end
if not carried then
  return -1
end
local acked = 0
for i = 5, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #entry == 1 and entry[1][2] == ARGV[2] then
    acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  end
end
return acked
