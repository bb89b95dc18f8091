-- user_delete: erase keys of one user in one step. The lane is among them, so a worker serving
-- a turn of the user at that moment holds a lane that no longer exists: its commit is fenced
-- (turn_commit.lua finds no lane of its token) and writes nothing, and with the inbox gone no
-- worker can take the lane again for a turn erased here.
--
-- KEYS[1]  fleet:u:{U}:<key>  the keys to erase (KEYS[1] and every other given), each of them
--          one of the user's (starting with ARGV[1]): one slot, the user's
-- ARGV[1]    the user's key prefix "fleet:u:{U}:"
--
-- Returns {erased, turn ids}: how many of KEYS existed (and are gone), and the members of the
-- user's done-set if it is among KEYS (the answered turn ids: the caller erases their reply
-- lists too, whichever of them a commit wrote before this call and after its caller looked).
-- An error 'BADKEYS ...' if a key is not the user's, 'NOPERM ...' if the caller's ACL may not
-- DEL one of them (nothing erased).
local prefix = ARGV[1]
if not prefix or not string.match(prefix, '^[^{}]*{[^{}]+}:$') then
  return redis.error_reply('BADARGS the user key prefix is not a hash-tagged prefix')
end
for _, key in ipairs(KEYS) do
  if string.sub(key, 1, #prefix) ~= prefix then
    return redis.error_reply('BADKEYS ' .. key .. ' is not a key of ' .. prefix)
  end
  -- the caller's own right to DEL each key (Redis >= 7): the client role, which may write an
  -- inbox but delete nothing, cannot erase a user through this function
  if redis.acl_check_cmd and not redis.acl_check_cmd('DEL', key) then
    return redis.error_reply("NOPERM this user has no permissions to run the 'del' command on " .. key)
  end
end
local ids = {}
local done = prefix .. 'done'
for _, key in ipairs(KEYS) do
  if key == done then
    local members = redis.pcall('ZRANGE', key, 0, -1)  -- a done-set of another type: no ids
    if type(members) == 'table' and not members['err'] then ids = members end
  end
end
local erased = 0
for _, key in ipairs(KEYS) do
  erased = erased + redis.call('DEL', key)
end
return {erased, ids}
