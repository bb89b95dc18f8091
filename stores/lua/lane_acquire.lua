-- lane_acquire: take a user's lane (lease) if it is free, with a new fencing token.
--
-- KEYS[1]  fleet:u:{U}:lane    string "<worker>|<token>" with a PX TTL
-- KEYS[2]  fleet:u:{U}:fence   counter of fencing tokens
-- KEYS[3]  fleet:u:{U}:state   hash; field "cursor" = last inbox id done
-- KEYS[4]  fleet:u:{U}:inbox   stream of the user's turns
-- ARGV[1]  worker id
-- ARGV[2]  lease TTL in milliseconds
-- ARGV[3]  how many inbox entries after the cursor to return (saves a round trip)
--
-- Returns {1, token, cursor, entries} when the caller holds the lane (new, or its own),
--         {0, holder, pttl}  when another worker holds it.
local held = redis.call('GET', KEYS[1])
local token
if held then
  local owner, current = string.match(held, '^(.*)|(%d+)$')
  if owner ~= ARGV[1] then
    return {0, held, redis.call('PTTL', KEYS[1])}
  end
  token = current
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  token = tostring(redis.call('INCR', KEYS[2]))
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
end
local cursor = redis.call('HGET', KEYS[3], 'cursor')
local start = '-'
if cursor then start = '(' .. cursor end
local entries = redis.call('XRANGE', KEYS[4], start, '+', 'COUNT', tonumber(ARGV[3]))
return {1, token, cursor or '', entries}
