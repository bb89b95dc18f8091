-- include/key_types: a fragment, not a script (see include/next_turn). Redis does not undo a
-- script that fails halfway: the writes before a failed command stay. So a script checks the
-- type of every key it is going to use before its first write, and a key that holds another
-- type (hostile or corrupt state) makes it answer with what it found, having written nothing.
-- A key the script reads before its first write is checked by that read (try): a TYPE call per
-- key on the way every turn takes would cost Redis more than the turn's own reads. A key it
-- only writes is checked by TYPE (wrong_types).
--
-- wrong_types(checks), checks a list of {role, key, type}; a missing key ('none') fits any type.
-- Returns a flat list {role, key, found, wanted, ...} of the keys that do not fit ({} if all do).
local function wrong_types(checks)
  local out = {}
  for _, check in ipairs(checks) do
    local found = redis.call('TYPE', check[2])['ok']
    if found ~= 'none' and found ~= check[3] then
      out[#out + 1] = check[1]
      out[#out + 1] = check[2]
      out[#out + 1] = found
      out[#out + 1] = check[3]
    end
  end
  return out
end

-- try(command, key, ...): the command's reply, or nil if ``key`` holds a type the command does
-- not read (a missing key reads as it does for redis.call: false, {} or 0). Any other error is
-- raised, as redis.call raises it. The caller then lists the keys with wrong_types.
local function try(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then  -- (tostring: fakeredis' error is no Lua string)
    if string.sub(tostring(reply.err), 1, 10) == 'WRONGTYPE ' then
      return nil
    end
    error(reply)
  end
  return reply
end
