-- lease_renew: extend a lease (a user's lane, the commander's leadership), only if the
-- caller still holds it with the same token.
--
-- KEYS[1]  the lease key: fleet:u:{U}:lane, or the commander's leader key
-- ARGV[1]  the holder string "<owner>|<token>" the caller got when it took the lease
-- ARGV[2]  lease TTL in milliseconds
--
-- Returns 1 if renewed, 0 if the lease is lost (expired or taken by another).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
