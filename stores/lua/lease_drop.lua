-- lease_drop: give up a lease unconditionally, only if the caller holds it: a draining
-- worker handing a user over (it then re-notifies), or a commander stepping down.
--
-- KEYS[1]  the lease key: fleet:u:{U}:lane, or the commander's leader key
-- ARGV[1]  the holder string "<owner>|<token>"
--
-- Returns 1 if dropped, 0 if the caller did not hold the lease.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
