-- consumer_drop: remove a consumer from a ready stream's group, only if it has no pending
-- entries. Deleting a consumer drops its pending entries (their notifications would be lost),
-- so the check and the delete are one atomic step: nothing can be delivered to it in between.
--
-- KEYS[1]  fleet:{T}:ready     the tier's ready stream
-- ARGV[1]  the consumer group ("workers")
-- ARGV[2]  the consumer name (a worker id)
--
-- Returns  1 removed,
--          0 no such consumer,
--         -1 kept: it still has pending entries.
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then
  return -1
end
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  for i = 1, #consumer, 2 do
    if consumer[i] == 'name' and consumer[i + 1] == ARGV[2] then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
      return 1
    end
  end
end
return 0
