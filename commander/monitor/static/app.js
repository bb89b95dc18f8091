// Fleet monitor: polls the commander's JSON API (/api/*) and redraws, no page reload, no
// build step, no third-party code. Every value from the API is put in the page as text
// (textContent), never as HTML. Charts are SVG drawn here.
"use strict";

const POLL_MS = 2000;      // tiers, workers and the open view
const CHART_MS = 5000;     // the tier charts change slowly (a sample every 5 s): read less often
const PAGE = 100;          // workers per page of the list (the API's default; at most 1,000)
const SVGNS = "http://www.w3.org/2000/svg";
const state = { view: "overview", user: null, tiers: [], charts: {}, chartAt: {}, sort: "turns",
                timer: null, busy: false, workerOffset: 0, workerNext: null };

// --- small DOM helpers ---------------------------------------------------------------
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v; else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "style") el.style.cssText = v;  // CSSOM: allowed by the page's CSP, an attribute is not
    else el.setAttribute(k, v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}
function s(tag, attrs, ...kids) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  for (const kid of kids.flat(Infinity)) if (kid) el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  return el;
}
const $ = (sel) => document.querySelector(sel);
const fmt = (v, d = 0) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const pct = (v) => (v === null || v === undefined ? "–" : `${Math.round(v * 100)}%`);
const hms = (ts) => (ts ? new Date(ts * 1000).toISOString().slice(11, 19) : "–");
function dur(sec) {
  if (sec === null || sec === undefined) return "–";
  if (sec >= 7200) return `${Math.floor(sec / 3600)}h`;
  if (sec >= 120) return `${Math.floor(sec / 60)}m`;
  return `${Math.floor(sec)}s`;
}
function fill(tbody, rows, cols, empty) {
  tbody.replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: cols }, empty))]));
}
const errorRow = (cols, what, msg) => h("tr", { class: "error" }, h("td", { colspan: cols }, `${what}: ${msg}`));

// --- the API --------------------------------------------------------------------------
async function api(path, opts) {
  let res;
  try {
    res = await fetch(`/api/${path}`, { credentials: "same-origin", cache: "no-store", ...opts });
  } catch (err) {
    return { status: 0, body: { error: `the commander does not answer (${err.message})` } };
  }
  let body;
  try { body = await res.json(); } catch (err) { body = { error: `HTTP ${res.status}` }; }
  if (res.status === 401) body = { error: "unauthorized: open /?token=<token> once" };
  return { status: res.status, body };
}
function banner(text, kind, link) {
  const el = $("#banner");
  if (!text) { el.hidden = true; return; }
  el.className = `banner ${kind || ""}`;
  el.replaceChildren(text, link ? h("a", { href: link }, link) : "");
  el.hidden = false;
}
// a standby answers 503 with the leader's URL; any other failure is shown and retried
function failed(res) {
  if (res.status === 503 && res.body.standby) {
    const leader = res.body.leader ? `The leader is ${res.body.leader}` : "No commander leads now";
    banner(`This commander (${res.body.standby}) is a standby. ${leader}${res.body.leader_url ? ": " : "."}`,
      "standby", res.body.leader_url);
    return true;
  }
  if (res.status !== 200) { banner(`${res.body.error || "error"} (retrying every ${POLL_MS / 1000}s)`, "error"); return true; }
  return false;
}

// --- tiers: panels with a chart of workers and demand over the last hour -------------
function stat(label, value) { return h("div", { class: "stat" }, h("b", { class: "num" }, value), h("span", {}, label)); }
function policyBlock(t) {
  const p = t.policy || {};
  const keys = ["handler", "concurrency", "users_per_instance", "target_buffer", "target_backlog_per_worker",
    "admission_threshold", "scale_down_stabilization_s", "max_step_up", "paused"];
  const dl = h("dl", {}, keys.filter((k) => k in p).map((k) => [h("dt", {}, k), h("dd", {}, JSON.stringify(p[k]))]));
  return h("div", { class: "policy" },
    h("div", {}, `policy from ${t.policy_source}`, t.reason ? ` · ${t.reason}` : "", t.held ? ` · held: ${t.held}` : ""),
    h("div", { class: "muted" }, "proposals: ", Object.entries(t.proposals || {}).filter(([, v]) => v !== null)
      .map(([k, v]) => `${k} ${v}`).join(", ") || "none"),
    t.policy_error ? h("div", { class: "rejected" }, `rejected edit: ${t.policy_error}`) : null, dl);
}
function steps(points, x, y) {  // a step line through [ts, value] points
  let d = "";
  points.forEach(([ts, v], i) => {
    d += i === 0 ? `M${x(ts)},${y(v)}` : `H${x(ts)}V${y(v)}`;
  });
  return d;
}
function chart(c) {
  const W = 440, H = 130, L = 28, R = 30, T = 8, B = 16;
  const svgEl = s("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  if (!c) return svgEl;
  const workers = [], desired = [], users = [];
  for (const [ts, w, d] of c.ledger) { workers.push([ts, w]); desired.push([ts, d]); }
  for (const row of c.samples) {
    workers.push([row[0], row[1] + row[2]]); desired.push([row[0], row[4]]); users.push([row[0], row[6]]);
  }
  if (workers.length) { workers.push([c.now, workers[workers.length - 1][1]]); desired.push([c.now, desired[desired.length - 1][1]]); }
  // the last hour, or since the first point when the data covers less (a new fleet, a new leader)
  const first = Math.min(...workers.map((p) => p[0]), ...users.map((p) => p[0]), c.now);
  const since = Math.max(c.since, Math.min(first, c.now - 60));
  const top = Math.max(1, ...workers.map((p) => p[1]), ...desired.map((p) => p[1]));
  const utop = Math.max(1, ...users.map((p) => p[1]));
  const x = (ts) => (L + ((Math.max(ts, since) - since) / Math.max(1, c.now - since)) * (W - L - R)).toFixed(1);
  const y = (v) => (T + (1 - v / top) * (H - T - B)).toFixed(1);
  const yu = (v) => (T + (1 - v / utop) * (H - T - B)).toFixed(1);
  svgEl.append(
    s("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    s("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
    s("text", { x: 2, y: T + 8 }, String(top)), s("text", { x: 2, y: H - B }, "0"),
    s("text", { x: W - R + 3, y: T + 8 }, String(utop)),
    s("text", { x: L, y: H - 3 }, `-${dur(c.now - since)}`), s("text", { x: W - R - 24, y: H - 3 }, "now"),
    s("path", { class: "users", d: steps(users, x, yu) }),
    s("path", { class: "desired", d: steps(desired, x, y) }),
    s("path", { class: "workers", d: steps(workers, x, y) }));
  return svgEl;
}
function share(g) { return `${fmt(g.share, 1)} % of new users (weight ${g.weight})`; }
function canaryBadge(g) { return g.canary ? h("span", { class: "badge canary" }, "canary") : null; }
function groupsBlock(t) {  // a group's pool: which group it is, and its tier's groups
  if (!t.groups) return null;
  const g = t.group;
  const line = !g ? null : g.removed
    ? h("div", { class: "group-of" }, `group ${g.group} of tier ${g.tier}: no longer in the policy, draining`)
    : h("div", { class: "group-of" }, `group ${g.group} of tier ${g.tier} · ${share(g)}`, canaryBadge(g),
      g.rejected ? h("div", { class: "rejected" }, `group rejected: ${g.rejected}`) : null);
  return h("div", {}, line, h("table", { class: "groups" },
    h("thead", {}, h("tr", {}, ["group", "share of new users", "weight", "ready", ""].map((c) => h("th", {}, c)))),
    h("tbody", {}, t.groups.map((x) => h("tr", { "data-group": x.group, class: g && x.group === g.group ? "mine" : null },
      h("td", {}, x.group), h("td", { class: "num" }, `${fmt(x.share, 1)} %`), h("td", { class: "num" }, String(x.weight)),
      h("td", { class: "num" }, x.ready === null ? "–" : String(x.ready)),
      h("td", {}, canaryBadge(x), x.rejected ? h("span", { class: "rejected" }, ` rejected: ${x.rejected}`) : ""))))));
}
function tierPanel(t) {
  return h("div", { class: "tier", "data-tier": t.tier },
    h("h3", {}, t.group ? `pool ${t.tier}` : `tier ${t.tier}`),
    groupsBlock(t),
    h("div", { class: "stats" },
      stat("ready", t.ready), stat("starting", t.starting), stat("draining", t.draining),
      stat("desired / target", `${t.desired} / ${t.target}`),
      stat("min / max", `${t.min_workers} / ${t.max_workers}`), stat("backlog", t.backlog),
      stat("active users", t.active_users), stat("turns/s", fmt(t.rps, 1)),
      stat("busy slots", `${t.busy_slots} / ${t.slots}`), stat("pressure", t.pressure),
      stat("dead letters", t.dead_letters === null ? "?" : t.dead_letters)),
    chart(state.charts[t.tier]),
    h("div", { class: "legend" }, h("span", { class: "k-workers" }, "— workers (ready + starting)"),
      h("span", { class: "k-desired" }, "- - desired"), h("span", { class: "k-users" }, "— active users (right axis)")),
    policyBlock(t));
}
async function refreshCharts(tiers) {
  const now = Date.now();
  await Promise.all(tiers.filter((t) => !(now - (state.chartAt[t.tier] || 0) < CHART_MS)).map(async (t) => {
    const res = await api(`history?tier=${encodeURIComponent(t.tier)}`);
    if (res.status === 200) { state.charts[t.tier] = res.body; state.chartAt[t.tier] = now; }
  }));
}

// --- workers: occupancy bars and the history of the evaluator window -----------------
function bar(v) {
  const w = Math.min(1, Math.max(0, v || 0)) * 100;
  const cls = v > 1 ? "bad" : v >= 0.8 ? "warn" : "";
  return h("span", { class: "bar", title: fmt(v, 2) }, h("i", { class: cls, style: `width:${w.toFixed(0)}%` }));
}
function histogram(values) {
  const W = 180, H = 22, n = Math.max(values.length, 1), bw = W / n;
  const el = s("svg", { class: "hist", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  values.forEach((v, i) => {
    const bh = Math.max(0.5, (Math.min(v, 100) / 100) * H);
    el.append(s("rect", { x: (i * bw).toFixed(2), y: (H - bh).toFixed(2), width: Math.max(bw - 0.5, 0.5).toFixed(2), height: bh.toFixed(2) }));
  });
  return el;
}
function workerRow(w) {
  const handler = w.handler_s_per_turn === null || w.handler_s_per_turn === undefined ? "–" : `${fmt(w.handler_s_per_turn * 1000, 0)} ms`;
  return h("tr", { "data-worker": w.worker },
    h("td", {}, w.worker, w.reception ? " (reception)" : ""), h("td", {}, w.tier),
    h("td", { class: `state-${w.state}` }, w.state, w.fresh ? "" : " (no fresh report)"),
    h("td", { class: "num" }, bar(w.occupancy), ` ${fmt(w.occupancy, 2)}`),
    h("td", { class: "num" }, `${pct(w.cpu)} / ${pct(w.memory)} / ${pct(w.slots_use)}`),
    h("td", {}, histogram(w.history || [])),
    h("td", { class: "num" }, fmt(w.turns_per_s, 2)), h("td", { class: "num" }, handler),
    h("td", { class: "num" }, `${w.busy}/${w.total}`), h("td", { class: "num" }, dur(w.age_s)),
    h("td", {}, w.pid ? `${w.pid}@${w.host}` : "–"));
}
function commanderRow(c) {
  return h("tr", {}, h("td", {}, c.commander), h("td", {}, c.alive === false ? `${c.role} (gone)` : c.role),
    h("td", {}, c.epoch ?? "–"), h("td", {}, c.pid ? `${c.pid}@${c.host}` : "–"), h("td", {}, `${fmt(c.seen_ago_s, 1)} s ago`),
    h("td", {}, c.monitor_url ? h("a", { href: c.monitor_url }, c.monitor_url) : "–"));
}
function failedJobs(queue, got) {  // a queue's failed jobs, each with Requeue (as `fleet jobs requeue`)
  const tb = h("tbody");
  if (got.error) fill(tb, [errorRow(5, "failed jobs", got.error)], 5, "");
  else {
    fill(tb, got.jobs.map((j) => h("tr", { "data-job": j.id }, h("td", {}, j.id), h("td", {}, j.description || "–"),
      h("td", {}, j.ended_at ? j.ended_at.slice(11, 19) : "–"), h("td", { style: "white-space:normal" }, j.error),
      h("td", {}, h("button", { type: "button", class: "requeue", onclick: () => requeue(queue, [j.id]) }, "Requeue")))),
    5, "no failed jobs");
  }
  return h("div", { class: "failed-jobs", "data-queue": queue },
    h("h4", {}, `failed jobs of queue ${queue} `,
      h("button", { type: "button", class: "requeue-all", onclick: () => requeue(queue, null) }, "Requeue all")),
    h("table", { class: "grid" }, h("thead", {}, h("tr", {}, ["job id", "job", "ended", "error", ""].map((c) => h("th", {}, c)))), tb));
}
async function requeue(queue, ids) {
  const res = await api("rq/requeue", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(ids ? { queue, ids } : { queue, all: true }) });
  $("#rq-result").textContent = res.status !== 200 || res.body.error ? `requeue failed: ${res.body.error}`
    : `requeued ${res.body.requeued.length} job(s) on ${queue}`;
  await refreshRq(state.tiers);
}
function rqTier(tier, t, failed) {  // an rq tier: its queue signals and its RQ workers (the view of `fleet status`)
  const queues = (t.queues || []).map((q) => q.name).join(", ");
  const rows = (t.rq_workers || []).map((w) => h("tr", { "data-rq-worker": w.worker },
    h("td", {}, w.worker), h("td", { class: w.state === "busy" ? "state-ready" : "" }, w.state),
    h("td", {}, w.job || "–"), h("td", { class: "num" }, dur(w.age_s))));
  const tb = h("tbody");
  fill(tb, rows, 4, "no RQ worker registered");
  return h("div", { class: "rq-tier", "data-rq-tier": tier },
    h("h3", {}, `${tier} `, h("span", { class: "muted" }, `queues ${queues}`)),
    h("div", { class: "stats" }, stat("queued", t.backlog), stat("started", t.pending),
      stat("failed", t.failed_jobs), stat("oldest queued", dur(t.oldest_job_age_s))),
    h("table", { class: "grid" }, h("thead", {}, h("tr", {}, h("th", {}, "RQ worker"), h("th", {}, "state"),
      h("th", {}, "job"), h("th", {}, "age"))), tb),
    (t.queues || []).filter((q) => failed[q.name]).map((q) => failedJobs(q.name, failed[q.name])));
}
async function refreshRq(tiers) {  // asked for only when a tier is of kind rq
  const section = $("#rq-section");
  section.hidden = !tiers.some((t) => t.policy && t.policy.kind === "rq");
  if (section.hidden) return;
  const res = await api("rq");
  const box = $("#rq-tiers");
  if (res.status !== 200 || res.body.error) { box.replaceChildren(h("div", { class: "tier error" }, `rq tiers: ${res.body.error}`)); return; }
  // the failed jobs of each queue that has some (one request per such queue)
  const queues = Object.values(res.body.tiers).flatMap((t) => (t.queues || []).filter((q) => q.failed > 0).map((q) => q.name));
  const failed = {};
  await Promise.all(queues.map(async (q) => {
    const got = await api(`rq/failed?queue=${encodeURIComponent(q)}&count=20`);
    failed[q] = got.status === 200 && !got.body.error ? got.body : { error: got.body.error || `HTTP ${got.status}` };
  }));
  box.replaceChildren(...Object.entries(res.body.tiers).map(([tier, t]) => rqTier(tier, t, failed)));
}
// one page of the worker list (of the tier chosen); a page past the end (the fleet shrank) goes
// back to the last one
async function workerPage() {
  const tier = $("#workers-tier").value;
  const path = (offset) => `workers?offset=${offset}&limit=${PAGE}${tier ? `&tier=${encodeURIComponent(tier)}` : ""}`;
  let res = await api(path(state.workerOffset));
  if (res.status === 200 && !res.body.error && !res.body.workers.length && res.body.total > 0) {
    state.workerOffset = Math.floor((res.body.total - 1) / PAGE) * PAGE;
    res = await api(path(state.workerOffset));
  }
  return res;
}
function pageControls(body) {
  const n = body ? body.workers.length : 0, total = body ? body.total : 0;
  state.workerNext = body ? body.next_offset : null;
  $("#workers-count").textContent = !body ? "" : n === total ? `(${total})`
    : `(${n ? `${body.offset + 1}–${body.offset + n}` : "none"} of ${total})`;
  $("#workers-prev").disabled = state.workerOffset === 0;
  $("#workers-next").disabled = state.workerNext === null;
}
async function refreshOverview(ov) {
  const [wres] = await Promise.all([workerPage(), refreshCharts(ov.tiers || []), refreshRq(ov.tiers || [])]);
  $("#problems").replaceChildren(...(ov.problems || []).map((p) =>
    h("div", { class: `problem ${p.kind}`, "data-kind": p.kind }, p.text)));
  const tiers = $("#tiers");
  if (ov.tiers_error) tiers.replaceChildren(h("div", { class: "tier error" }, ov.tiers_error));
  else tiers.replaceChildren(...ov.tiers.map(tierPanel));
  const cm = ov.commanders || {};
  const ctb = $("#commanders tbody");
  if (cm.error) fill(ctb, [errorRow(6, "commanders", cm.error)], 6, "");
  else fill(ctb, (cm.list || []).map(commanderRow), 6, "no commander registered");
  const tb = $("#workers tbody");
  if (wres.status !== 200 || wres.body.error) {
    fill(tb, [errorRow(11, "workers", wres.body.error)], 11, "");
    pageControls(null);
    return;
  }
  fill(tb, wres.body.workers.map(workerRow), 11, "no workers");
  pageControls(wres.body);
}

// --- population, user page, ledger, dead letters --------------------------------------
function tierOptions() {
  for (const sel of document.querySelectorAll(".tier-select")) {
    const names = state.tiers.map((t) => t.tier);
    const want = (sel.dataset.any ? [""] : []).concat(names);
    if (sel.options.length === want.length && [...sel.options].every((o, i) => o.value === want[i])) continue;
    const keep = sel.value;
    sel.replaceChildren(...want.map((n) => h("option", { value: n }, n || "all tiers")));
    if (want.includes(keep)) sel.value = keep;
  }
}
const COLS = ["user", "turns", "handler_ms", "chars_in", "chars_out", "errors", "last_active_ts"];
async function refreshPopulation() {
  const tier = $("#population-tier").value, q = $("#population-q").value;
  if (!tier) return;
  const res = await api(`population?tier=${encodeURIComponent(tier)}&q=${encodeURIComponent(q)}&sort=${state.sort}`);
  const tb = $("#population tbody");
  for (const th of document.querySelectorAll("#population th")) th.classList.toggle("sorted", th.dataset.col === state.sort);
  if (res.status !== 200 || res.body.error) { fill(tb, [errorRow(7, "population", res.body.error)], 7, ""); return; }
  $("#population-count").textContent = `${res.body.users.length} of ${res.body.total} active users`;
  fill(tb, res.body.users.map((u) => h("tr", {}, COLS.map((c) => h("td", { class: c === "user" ? "" : "num" },
    c === "user" ? h("a", { href: `#/user/${encodeURIComponent(u.user)}` }, u.user)
      : c === "last_active_ts" ? hms(u[c]) : c === "handler_ms" ? fmt((u[c] || 0) / 1000, 2) : typeof u[c] === "number" ? fmt(u[c], Number.isInteger(u[c]) ? 0 : 2) : u[c] ?? "–")))),
  7, "no active users");
}
function valueView(v) {  // any JSON value, as a readable block (the user page's sections)
  if (Array.isArray(v)) {
    if (!v.length) return h("span", { class: "muted" }, "none");
    if (v.every((x) => x && typeof x === "object" && !Array.isArray(x))) {
      const cols = [...new Set(v.flatMap((x) => Object.keys(x)))];
      return h("table", { class: "grid" }, h("thead", {}, h("tr", {}, cols.map((c) => h("th", {}, c)))),
        h("tbody", {}, v.map((x) => h("tr", {}, cols.map((c) => h("td", {}, typeof x[c] === "object" && x[c] !== null ? JSON.stringify(x[c]) : x[c] ?? "–"))))));
    }
    return h("span", {}, v.map((x) => JSON.stringify(x)).join(", "));
  }
  if (v && typeof v === "object") return h("dl", { class: "kv" }, Object.entries(v).map(([k, x]) => [h("dt", {}, k), h("dd", {}, valueView(x))]));
  return v === null || v === undefined ? "–" : String(v);
}
async function refreshUser() {
  $("#user-id").textContent = state.user;
  const res = await api(`users/${encodeURIComponent(state.user)}`);
  const box = $("#user");
  if (res.status !== 200 || res.body.error) { box.replaceChildren(h("div", { class: "banner" }, `user: ${res.body.error}`)); return; }
  box.replaceChildren(valueView(res.body.view));
}
async function refreshLedger() {
  const tier = $("#ledger-tier").value;
  const res = await api(`ledger?count=200${tier ? `&tier=${encodeURIComponent(tier)}` : ""}`);
  const tb = $("#ledger tbody");
  if (res.status !== 200 || res.body.error) { fill(tb, [errorRow(6, "ledger", res.body.error)], 6, ""); return; }
  fill(tb, res.body.events.map((e) => e.corrupt ? errorRow(6, `entry ${e.id}`, `corrupt: ${e.corrupt}`) :
    h("tr", {}, h("td", {}, hms(e.ts)), h("td", {}, e.tier), h("td", {}, e.action),
      h("td", { class: "num" }, `${e.from_count} → ${e.to_count}`), h("td", { style: "white-space:normal" }, e.reason),
      h("td", {}, `${e.commander} (epoch ${e.epoch})`))), 6, "the ledger is empty");
}
async function deadAction(kind, tier, ids) {
  if (kind === "purge" && !window.confirm(`Purge ${ids ? ids.length : "every"} dead letter(s) of ${tier}?`)) return;
  const res = await api(`dead-letters/${kind}`, { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(ids ? { tier, ids } : { tier, all: true }) });
  const out = $("#dead-result");
  if (res.status !== 200 || res.body.error) out.textContent = `${kind} failed: ${res.body.error}`;
  // a retry says how many turns it re-enqueued, not how many ids it sent (a row shown before
  // someone else purged or retried it comes back "unknown": nothing was retried for it)
  else out.textContent = kind === "retry" ? res.body.summary : `purged ${res.body.purged}`;
  await refreshDead();
}
async function refreshDead() {
  const tier = $("#dead-tier").value;
  if (!tier) return;
  const res = await api(`dead-letters?tier=${encodeURIComponent(tier)}&count=200`);
  const tb = $("#dead tbody");
  if (res.status !== 200 || res.body.error) { fill(tb, [errorRow(6, "dead letters", res.body.error)], 6, ""); return; }
  $("#dead-count").textContent = `(${res.body.total} in ${tier})`;
  fill(tb, res.body.dead_letters.map((d) => h("tr", { "data-id": d.id }, h("td", {}, hms(Number(d.ts))),
    h("td", {}, h("a", { href: `#/user/${encodeURIComponent(d.user || "")}` }, d.user || "–")), h("td", {}, d.turn_id || "–"),
    h("td", { style: "white-space:normal" }, d.reason || "–"), h("td", {}, d.worker || "–"),
    h("td", {}, h("button", { type: "button", class: "retry", onclick: () => deadAction("retry", tier, [d.id]) }, "Retry"), " ",
      h("button", { type: "button", class: "purge danger", onclick: () => deadAction("purge", tier, [d.id]) }, "Purge")))),
  6, "no dead letters");
}

// --- the loop -------------------------------------------------------------------------
function route() {
  const hash = location.hash || "#/";
  const m = hash.match(/^#\/user\/(.+)$/);
  state.user = m ? decodeURIComponent(m[1]) : null;
  state.view = m ? "user" : { "#/population": "population", "#/ledger": "ledger", "#/dead-letters": "dead" }[hash] || "overview";
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== `view-${state.view}`;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === state.view);
}
async function refresh() {
  const ov = await api("overview");
  if (failed(ov)) { $("#status").textContent = `not updated since ${hms(state.last)}`; return; }
  banner(null);
  state.tiers = ov.body.tiers || [];
  tierOptions();
  const views = { overview: () => refreshOverview(ov.body), population: refreshPopulation, ledger: refreshLedger,
    dead: refreshDead, user: refreshUser };
  await views[state.view]();
  state.last = Date.now() / 1000;
  const lead = ov.body.commanders && ov.body.commanders.leader;
  $("#status").textContent = `${ov.body.commander} leads${lead ? ` (epoch ${ov.body.commanders.epoch})` : ""} · updated ${hms(state.last)}`;
}
async function tick() {
  clearTimeout(state.timer);
  if (!state.busy) {
    state.busy = true;
    try { await refresh(); } catch (err) { banner(`monitor page error: ${err.message}`, "error"); } finally { state.busy = false; }
  }
  state.timer = setTimeout(tick, POLL_MS);
}
window.addEventListener("hashchange", () => { route(); tick(); });
for (const th of document.querySelectorAll("#population th")) {
  th.addEventListener("click", () => { state.sort = th.dataset.col; tick(); });
}
let typing;
$("#population-q").addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(tick, 250); });
$("#workers-tier").addEventListener("change", () => { state.workerOffset = 0; });  // (before the tick below)
for (const sel of document.querySelectorAll(".tier-select")) sel.addEventListener("change", tick);
$("#workers-prev").addEventListener("click", () => { state.workerOffset = Math.max(0, state.workerOffset - PAGE); tick(); });
$("#workers-next").addEventListener("click", () => {
  if (state.workerNext !== null) { state.workerOffset = state.workerNext; tick(); }
});
$("#dead-retry-all").addEventListener("click", () => deadAction("retry", $("#dead-tier").value, null));
$("#dead-purge-all").addEventListener("click", () => deadAction("purge", $("#dead-tier").value, null));
route();
tick();
