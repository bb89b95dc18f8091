-- lane_release: give up a user's lane, but only if nothing newer waits in the inbox.
--
-- KEYS[1]  fleet:u:{U}:lane
-- KEYS[2]  fleet:u:{U}:state   field "cursor"
-- KEYS[3]  fleet:u:{U}:inbox
-- ARGV[1]  "<worker>|<token>"
--
-- Returns  {1}      released (inbox empty after the cursor),
--          {0, cursor} kept: a turn waits after the cursor ('' = none yet), the caller must go
--                   on serving from that cursor (its own may be ahead of it: a failover can
--                   lose a commit the old master acknowledged),
--          {-1}     the caller no longer holds the lane.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {-1}
end
local cursor = redis.call('HGET', KEYS[2], 'cursor')
local start = '-'
if cursor then start = '(' .. cursor end
if #redis.call('XRANGE', KEYS[3], start, '+', 'COUNT', 1) > 0 then
  return {0, cursor or ''}
end
redis.call('DEL', KEYS[1])
return {1}
