-- opgate quota reservations: admit-and-reserve as one atomic step, shared by every replica.
--
-- KEYS[1]      the scope's sorted set: member "<name>|<token>" -> expiry (microseconds).
-- ARGV[1]      "" in production (time comes from redis TIME); an explicit now (microseconds)
--              only in the table tests that compare this script with proxy/stores/base.py
--              (then the key gets no expiry: the test clock is not the server's).
-- ARGV[2]      "reserve" or "settle".
--
-- reserve: ARGV[3] member, ARGV[4] observed, ARGV[5] limit (< 0: none), ARGV[6] ttl_us,
--          ARGV[7] "1" = check only (a dry-run create), ARGV[8..] seen: names, and
--          "|<token>" entries, whose objects the caller's watch already counts, and
--          "/<name>" for names whose object it showed and saw deleted: a member marked
--          shown ("<name>|<token>~") of such a name is the deleted object's, not counted.
--          Returns {allowed, used}: used = observed + live members not seen; allowed when
--          limit < 0 or used + 1 <= limit, and then the member is added (unless check only).
--          A member whose name a counted live member has already is the same object: allowed
--          when used <= limit, and nothing is added.
-- settle:  ARGV[3] member, ARGV[4] ttl_us (< 0: drop the member). Otherwise the member now
--          expires within ttl_us, never later than it already would. A member is found marked
--          shown or not; ARGV[3] ending "~" marks it (its creator's watch showed the object).
--          Returns {found}.
--
-- Same operations as proxy.stores.base.reserve_step / settle_step. Expired members (expiry <=
-- now) are removed first; the key itself expires with its last member.

if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local key = KEYS[1]
local now
local explicit = ARGV[1] ~= nil and ARGV[1] ~= ""
if explicit then
  now = tonumber(ARGV[1])
else
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

redis.call("ZREMRANGEBYSCORE", key, "-inf", string.format("%.0f", now))

local function expire_key()
  if explicit then
    return
  end
  local last = redis.call("ZRANGE", key, -1, -1, "WITHSCORES")
  if last[2] == nil then
    return
  end
  local ttl = math.ceil((tonumber(last[2]) - now) / 1000)
  if ttl < 1 then
    ttl = 1
  end
  redis.call("PEXPIRE", key, ttl)
end

local op = ARGV[2]
local member = ARGV[3]

if op == "settle" then
  local ttl = tonumber(ARGV[4])
  local shown = string.sub(member, -1) == "~"
  local base = shown and string.sub(member, 1, -2) or member
  local found = base
  local expiry = redis.call("ZSCORE", key, base)
  if not expiry then
    found = base .. "~"
    expiry = redis.call("ZSCORE", key, found)
  end
  if not expiry then
    return {0}
  end
  if ttl < 0 then
    redis.call("ZREM", key, found)
  else
    local score = tonumber(expiry)
    local until_ = now + ttl
    if until_ < score then
      score = until_
    end
    if shown and found ~= member then
      redis.call("ZREM", key, found)
      redis.call("ZADD", key, string.format("%.0f", score), member)
    elseif score < tonumber(expiry) then
      redis.call("ZADD", key, string.format("%.0f", score), found)
    end
  end
  expire_key()
  return {1}
end

local observed = tonumber(ARGV[4])
local limit = tonumber(ARGV[5])
local ttl = tonumber(ARGV[6])
local check_only = ARGV[7] == "1"
local seen = {}
for i = 8, #ARGV do
  seen[ARGV[i]] = true
end

local bar = string.find(member, "|", 1, true)
local own = bar and string.sub(member, 1, bar - 1) or member
local same = false
local used = observed
for _, m in ipairs(redis.call("ZRANGE", key, 0, -1)) do
  local bar = string.find(m, "|", 1, true)
  local name, token
  if bar then
    name = string.sub(m, 1, bar - 1)
    token = string.sub(m, bar)
  else
    name = m
    token = "|"
  end
  local shown = string.sub(token, -1) == "~"
  if shown then
    token = string.sub(token, 1, -2)
  end
  if not ((name ~= "" and seen[name]) or seen[token] or (shown and seen["/" .. name])) then
    used = used + 1
    if own ~= "" and name == own then
      same = true
    end
  end
end

-- the same object as a live reservation (an apply racing the create it follows, or a second
-- create of the name): it needs no more room than that one already holds, and adds nothing
if same then
  expire_key()
  if limit < 0 or used <= limit then
    return {1, used}
  end
  return {0, used}
end

local allowed = 0
if limit < 0 or used + 1 <= limit then
  allowed = 1
  if not check_only then
    redis.call("ZADD", key, string.format("%.0f", now + ttl), member)
  end
end
expire_key()
return {allowed, used}
