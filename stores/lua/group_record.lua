-- group_record: record the group a user's turns of a tier go to, with the epoch of the weights it
-- was chosen by (protocol.groups.settle), if the record is still the one the caller read: a
-- compare-and-set, so of two readers that decided on the same record, one writes and the other
-- follows what it wrote.
--
-- KEYS[1]  the user's pins hash: fleet:u:{U}:pins (a tier's record is its field "@<tier>")
-- ARGV[1]  the field "@<tier>"
-- ARGV[2]  the record the caller read ("" for none)
-- ARGV[3]  the new record "<group>|<epoch>"
--
-- Returns the record in force: ARGV[3] once written, else the one found; false when the key
-- holds another type (nothing is written: the caller goes by its own choice).
local found_type = redis.call('TYPE', KEYS[1])['ok']
if found_type ~= 'none' and found_type ~= 'hash' then
  return false
end
local found = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if found ~= ARGV[2] then
  return found
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return ARGV[3]
