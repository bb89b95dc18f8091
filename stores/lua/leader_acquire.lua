-- leader_acquire: become the commander (leader) if nobody is, with a new fencing epoch.
--
-- KEYS[1]  {fleet:events}:leader   string "<commander>|<epoch>" with a PX TTL
-- KEYS[2]  {fleet:events}:epoch    counter of epochs: every leadership gets a larger one
-- ARGV[1]  commander id
-- ARGV[2]  lease TTL in milliseconds
--
-- Returns {1, epoch} when the caller is the leader (new, or already it),
--         {0, holder} when another commander is.
local held = redis.call('GET', KEYS[1])
if held then
  local owner, epoch = string.match(held, '^(.*)|(%d+)$')
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, epoch}
  end
  return {0, held}
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. epoch, 'PX', ARGV[2])
return {1, tostring(epoch)}
