-- lane_drop: give up a user's lane unconditionally (a draining worker handing the user over).
-- The caller then posts a fresh notification for the user, so the turns still in the inbox
-- are picked up by another worker at once.
--
-- KEYS[1]  fleet:u:{U}:lane
-- ARGV[1]  "<worker>|<token>"
--
-- Returns 1 if dropped, 0 if the caller did not hold the lane.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
