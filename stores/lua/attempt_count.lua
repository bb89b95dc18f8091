-- attempt_count: count a retry's attempt of an inbox entry, or take back the attempt a lease
-- counted (a hand-over is no attempt), each once per id (include/next_turn's count_attempt): a
-- call sent again after its reply was lost changes nothing more.
--
-- KEYS[1]  fleet:u:{U}:state    hash; "att:<entry>" = "<count>|<id>"
-- KEYS[2]  fleet:u:{U}:inbox    a count is only for an entry still there (an erased user's
--                               state is not written again by a late retry)
-- ARGV[1]  the inbox entry id
-- ARGV[2]  'count': a fresh nonce naming this retry; 'uncount': the lease's fencing token
-- ARGV[3]  'count' or 'uncount'
--
-- Returns the entry's attempt count after the call. An uncount takes back only the count of
-- the lease named, and only while it is the last one counted.
-- @include next_turn

if ARGV[3] == 'count' then
  if redis.call('TYPE', KEYS[2])['ok'] ~= 'stream' or #redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1]) == 0 then
    return 0
  end
  return count_attempt(KEYS[1], ARGV[1], ARGV[2])
end
local field = 'att:' .. ARGV[1]
local held = redis.call('HGET', KEYS[1], field)
local count, by = string.match(held or '', '^(%d+)|(.*)$')
if not count then
  return tonumber(held) or 0
end
if by ~= ARGV[2] then
  return tonumber(count)
end
local n = math.max(tonumber(count) - 1, 0)
redis.call('HSET', KEYS[1], field, n .. '|' .. ARGV[2] .. '~')
return n
