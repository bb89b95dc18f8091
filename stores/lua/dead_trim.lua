-- dead_trim: count the bytes of the dead letters a tier keeps, and trim the oldest while the
-- stream holds more than ARGV[2] entries or ARGV[3] bytes. An entry's bytes are the lengths of
-- its field names and values, as the writer counts them (stores/deadletters.py entry_bytes).
--
-- KEYS[1]  fleet:{T}:dead        stream of dead letters
-- KEYS[2]  fleet:{T}:dead-bytes  counter: the bytes of the entries counted in and not trimmed
-- ARGV[1]  bytes to add to the counter (an entry just appended; negative: entries removed)
-- ARGV[2]  most entries kept
-- ARGV[3]  most bytes kept
--
-- Returns how many entries were trimmed. A counter that is no number (hand-written) starts again
-- from ARGV[1]; it is 0 again whenever the stream is empty, so an entry removed without
-- counting it out (XDEL by hand) costs at most an early trim until then.
local add, max_n, max_b = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if not (add and max_n and max_b) then
  return redis.error_reply('BADARGS byte count and bounds must be numbers')
end
local stored = redis.pcall('GET', KEYS[2])
local total = tonumber(type(stored) == 'string' and stored or nil) or 0
total = total + add
local n = redis.call('XLEN', KEYS[1])
local trimmed = 0
while n > 0 and (n > max_n or total > max_b) do
  local rows = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 100)
  if #rows == 0 then break end
  for _, row in ipairs(rows) do
    if not (n > max_n or total > max_b) then break end
    local size = 0
    for _, part in ipairs(row[2]) do size = size + #part end
    redis.call('XDEL', KEYS[1], row[1])
    n, total, trimmed = n - 1, total - size, trimmed + 1
  end
end
if n == 0 or total < 0 then total = 0 end
redis.call('SET', KEYS[2], tostring(total))
return trimmed
