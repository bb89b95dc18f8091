-- lane_acquire: take a user's lane (lease) if it is free, with a new fencing token.
--
-- KEYS[1]  fleet:u:{U}:lane    string "<worker>|<token>" with a PX TTL
-- KEYS[2]  fleet:u:{U}:fence   counter of fencing tokens
-- KEYS[3]  fleet:u:{U}:state   hash; field "cursor" = last inbox id done
-- ARGV[1]  worker id
-- ARGV[2]  lease TTL in milliseconds
--
-- Returns {1, token, cursor} when the caller holds the lane (new, or already its own),
--         {0, holder, pttl}  when another worker holds it.
local held = redis.call('GET', KEYS[1])
local cursor = redis.call('HGET', KEYS[3], 'cursor') or ''
if held then
  local owner, token = string.match(held, '^(.*)|(%d+)$')
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, token, cursor}
  end
  return {0, held, redis.call('PTTL', KEYS[1])}
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return {1, tostring(token), cursor}
