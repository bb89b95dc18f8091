-- submit_pressure: after a submit, post a pressure event if the tier had no free slot.
--
-- Sent right after turn_submit, in the same round trip but as its own call: Redis hands a new
-- notification to a worker blocked in XREADGROUP once the command that wrote it has ended and
-- before it runs the next one, so a lag still there now means no worker could take it. (Read
-- inside turn_submit, the lag would always count the submit's own notifications.) The client
-- sends it at most once per SUBMIT_PRESSURE_CHECK_S per tier (stores/submit.py), not on every
-- submit: the commander's pass sees the backlog anyway.
--
-- KEYS[1]  fleet:{T}:ready      the ready shard the submit wrote last (its lag: a sample)
-- KEYS[2]  fleet:{T}:starting   handler slots of workers still starting (absent: 0)
-- KEYS[3]  fleet:{T}:pressure   stream of pressure events
-- ARGV[1]  consumer group name  (protocol.keys.GROUP)
-- ARGV[2]  approximate max length of the pressure stream
-- ARGV[3..] the event's fields and values (tier, user, ts)
--
-- Returns 1 if an event was posted (the group's lag exceeds the starting slots, or no worker
-- ever created the group), else 0 (no lag, or Redis cannot tell the lag after deletions).
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then
  return 0
end
local lag, found = false, false
for _, group in ipairs(groups) do
  local fields = {}
  for i = 1, #group - 1, 2 do fields[group[i]] = group[i + 1] end
  if fields['name'] == ARGV[1] then
    found = true
    lag = fields['lag']
  end
end
if found then
  if not lag then return 0 end
  if tonumber(lag) <= (tonumber(redis.call('GET', KEYS[2]) or '0') or 0) then return 0 end
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', (table.unpack or unpack)(ARGV, 3))
return 1
