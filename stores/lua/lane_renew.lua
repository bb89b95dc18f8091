-- lane_renew: extend a lane lease, only if the caller still holds it with the same token.
--
-- KEYS[1]  fleet:u:{U}:lane
-- ARGV[1]  "<worker>|<token>" as returned by lane_acquire
-- ARGV[2]  lease TTL in milliseconds
--
-- Returns 1 if renewed, 0 if the lane is lost (expired or taken by another worker).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
