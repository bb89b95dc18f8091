-- lane_clear: the commander clears a user's lane held by a worker it knows is dead, so its
-- users are taken over at once instead of when the lease expires. Every commit, renew and
-- release checks GET lane == "<worker>|<token>", so once the lane is gone (or re-taken with a
-- new token) a worker that was only paused can no longer write: it is fenced.
--
-- KEYS[1]  fleet:u:{U}:lane    string "<worker>|<token>" with a PX TTL
-- ARGV[1]  the dead worker's id
--
-- Returns 1 if the lane was held by ARGV[1] and is now deleted,
--         0 if it is free or held by another worker (left untouched).
local held = redis.call('GET', KEYS[1])
if not held then
  return 0
end
local owner = string.match(held, '^(.*)|%d+$')
if owner ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
