// The dashboard page: a hash router over five views (overview, rollouts, one rollout, compare, canaries), the
// JSON API with the operator key, and the live event stream read with fetch (EventSource cannot
// send the key in a header).
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const view = $("#view");
const state = {
  key: sessionStorage.getItem("agentstream-key") || "",
  range: localStorage.getItem("agentstream-range") || "1h",
  feed: [],
  rates: null,
  route: null,
  overview: null,
  refreshTimer: null,
  lastRefresh: 0,
  cursors: [],
};

// --- formatting --------------------------------------------------------------------------------

const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
function num(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
const int = (v) => (v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US"));
const pct = (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(1)} %`);
const ms = (v) => (v === null || v === undefined ? "–" : v >= 10000 ? `${(v / 1000).toFixed(1)} s` : `${num(v, v < 10 ? 1 : 0)} ms`);
const clock = (t) => (t ? new Date(t).toLocaleTimeString([], { hour12: false }) : "–");
const when = (t) => (t ? new Date(t).toLocaleString([], { hour12: false }) : "–");
const short = (id) => (id && id.length > 14 ? `${id.slice(0, 8)}…${id.slice(-4)}` : id || "–");
const badge = (text) => `<span class="badge ${esc(text)}">${esc(text ?? "–")}</span>`;
const VERSION_COLORS = ["#5fb3ff", "#c792ea", "#f2b84b", "#4cc38a", "#f78c6c", "#89ddff", "#ff5370", "#c3e88d"];
const versionColor = (v) => (v === null || v === undefined ? "#445" : VERSION_COLORS[((v % 8) + 8) % 8]);

function sqlBlock(sql) {
  return sql ? `<details class="sql"><summary>SQL (agentstream sql)</summary><pre>${esc(sql.replace(/\s+/g, " ").trim())}</pre></details>` : "";
}

// --- the API -----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, params = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) {
    if (Array.isArray(v)) v.forEach((x) => url.searchParams.append(k, x));
    else if (v !== null && v !== undefined && v !== "") url.searchParams.set(k, v);
  }
  const response = await fetch(url, { headers: { Authorization: `Bearer ${state.key}` } });
  if (response.status === 401) { showLogin("That key was refused."); throw new ApiError(401, "no valid key"); }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new ApiError(response.status, body.error?.message || `HTTP ${response.status}`);
  return body;
}

function showLogin(message) {
  $("#login").hidden = false;
  const error = $("#login-error");
  error.hidden = !message || !state.key;
  error.textContent = message || "";
  $("#key").focus();
}

$("#login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  state.key = $("#key").value.trim();
  try {
    await api("/api/session");
    sessionStorage.setItem("agentstream-key", state.key);
    $("#login").hidden = true;
    connectLive();
    render();
  } catch (err) { if (err.status !== 401) showLogin(err.message); }
});
$("#logout").addEventListener("click", () => { sessionStorage.removeItem("agentstream-key"); location.reload(); });
$("#range").value = state.range;
$("#range").addEventListener("change", (e) => {
  state.range = e.target.value;
  localStorage.setItem("agentstream-range", state.range);
  render();
});

// --- live events -------------------------------------------------------------------------------

let liveAbort = null;
async function connectLive() {
  if (liveAbort) liveAbort.abort();
  liveAbort = new AbortController();
  const indicator = $("#live");
  try {
    const response = await fetch("/api/events", { headers: { Authorization: `Bearer ${state.key}` }, signal: liveAbort.signal });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    indicator.className = "live on";
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const chunk = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = chunk.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) onNotice(JSON.parse(data));
      }
    }
  } catch (err) {
    if (err.name === "AbortError") return;
  }
  indicator.className = "live off";
  $("span", indicator).textContent = "reconnecting…";
  setTimeout(connectLive, 2000);
}

function onNotice(n) {
  if (n.kind === "rates") {
    state.rates = n.rates;
    $("#live span").textContent = n.error ? `live: ${n.error}` : `live · ${num(n.rates.calls, 1)} calls/s · ${num(n.rates.trajectories, 1)} traj/s`;
    return;
  }
  state.feed.unshift({ ...n, fresh: true });
  state.feed.length = Math.min(state.feed.length, 200);
  const feed = $("#feed");
  if (feed) feed.innerHTML = feedHtml();
  scheduleRefresh();
}

// a new event makes the current numbers stale: read them again, at most every few seconds
function scheduleRefresh() {
  const route = state.route?.name;
  if (route !== "overview" && route !== "canaries" && !(route === "rollouts" && !state.route.params.get("cursor"))) return;
  if (state.refreshTimer) return;
  // a view that took long to read is read again less often: at most a third of the time spent reading
  const every = Math.max(3000, 3 * (state.overview?.took_ms || 0));
  const wait = Math.max(0, every - (Date.now() - state.lastRefresh));
  state.refreshTimer = setTimeout(() => { state.refreshTimer = null; render({ quiet: true }); }, wait);
}

function feedHtml() {
  if (!state.feed.length) return '<div class="empty">waiting for new events…</div>';
  const html = state.feed.slice(0, 60).map((e) => {
    let what = esc(e.type);
    if (e.type === "trajectory") what = `trajectory ${badge(e.status)} reward <b>${num(e.reward, 2)}</b> · v${e.weight_version ?? "–"} · ${int(e.generated)} tokens`;
    else if (e.type === "reward") what = `reward <b>${num(e.reward, 2)}</b> ${esc(e.reward_fn || "posted")}`;
    else if (e.type === "weights") what = `weights <b>v${e.version}</b> (${int(e.samples)} samples)`;
    else if (e.type === "release") what = `canary ${esc(e.model)} <b>v${e.version}</b> ${badge(e.action)}${e.p_value !== null && e.p_value !== undefined ? ` p=${num(e.p_value, 4)}` : ""}`;
    else if (e.type === "pool.update") what = `swap to <b>v${e.version}</b> on ${esc(e.server)} ${badge(e.status)} paused ${ms(e.pause_ms)}`;
    const link = e.rollout_id ? ` <a href="${rolloutHref(e.rollout_id, e.topic_base === "trajectories" ? e : null)}" class="mono">${esc(short(e.rollout_id))}</a>` : "";
    const cls = e.fresh ? ' class="fresh"' : "";
    e.fresh = false;
    return `<div${cls} data-feed-rollout="${esc(e.rollout_id || "")}"><time>${clock(e.time)}</time><span>${what}${link}</span></div>`;
  });
  return html.join("");
}

function rolloutHref(id, row) {
  const q = new URLSearchParams();
  if (row && row.partition !== undefined) { q.set("p", row.partition); q.set("o", row.offset); }
  if (row && row.attempt_id) q.set("attempt", row.attempt_id);
  return `#/rollout/${encodeURIComponent(id)}${q.toString() ? "?" + q : ""}`;
}

// --- router ------------------------------------------------------------------------------------

function parseRoute() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean);
  return { name: parts[0] || "overview", arg: parts[1] ? decodeURIComponent(parts[1]) : null, params: new URLSearchParams(query || "") };
}

let renderSeq = 0;
async function render(opts = {}) {
  const route = parseRoute();
  state.route = route;
  state.lastRefresh = Date.now();
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === (route.name === "rollout" ? "rollouts" : route.name)));
  const seq = ++renderSeq;
  const pages = { overview: renderOverview, rollouts: renderRollouts, rollout: renderRollout, compare: renderCompare, canaries: renderCanaries };
  const page = pages[route.name] || renderOverview;
  if (!opts.quiet) view.innerHTML = '<div class="muted">reading the log…</div>';
  try {
    const html = await page(route);
    if (seq !== renderSeq) return;  // a newer render started meanwhile
    if (html !== null) { view.innerHTML = html; after(route); }
  } catch (err) {
    if (seq !== renderSeq || err.status === 401) return;
    view.innerHTML = `<div class="banner" role="alert">${esc(err.message)}</div>` + (route.name === "rollouts" ? filtersHtml(route.params) : "");
    if (route.name === "rollouts") bindFilters();
  }
}
window.addEventListener("hashchange", () => render());

function after(route) {
  if (route.name === "overview") drawOverviewCharts();
  if (route.name === "rollouts") bindFilters();
  if (route.name === "rollout") bindTabs();
  if (route.name === "compare") bindCompare();
}

// --- overview ----------------------------------------------------------------------------------

function stat(name, label, value, sub, raw) {
  return `<div class="stat" data-stat="${name}" data-value="${raw ?? ""}"><div class="label">${label}</div><div class="value">${value}</div><div class="sub">${sub}</div></div>`;
}

function table(rows, columns, empty = "nothing in this range") {
  if (!rows || !rows.length) return `<div class="empty">${empty}</div>`;
  const head = columns.map((c) => `<th class="${c.num ? "num" : ""}">${c.label}</th>`).join("");
  const body = rows.map((r) => `<tr>${columns.map((c) => `<td class="${c.num ? "num" : ""}" data-col="${c.key || ""}">${c.fmt ? c.fmt(r[c.key], r) : esc(r[c.key])}</td>`).join("")}</tr>`).join("");
  return `<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

async function renderOverview() {
  const o = await api("/api/overview", { since: state.range });
  state.overview = o;
  const calls = o.calls.rows[0] || {}, rollouts = o.rollouts.rows[0] || {}, settle = o.settle.rows[0] || {};
  const r = o.rates;
  const lagTotal = Object.values(o.lag.topics || {}).reduce((a, b) => a + b, 0);
  const span = r.seconds >= 3600 ? `${num(r.seconds / 3600, 1)} h` : `${num(r.seconds / 60, 1)} min`;
  const panelError = (a) => (a.error ? `<div class="banner">${esc(a.error)}</div>` : "");
  return `
    <h1>Overview <span class="muted" style="font-size:13px;font-weight:400">over ${span}, read in ${int(o.took_ms)} ms</span></h1>
    <div class="stats">
      ${stat("calls", "calls / s", num(r.calls_per_s, 2), `${int(calls.calls || 0)} calls · ${int(calls.errors || 0)} errors`, calls.calls || 0)}
      ${stat("rollouts", "rollouts / s", num(r.rollouts_per_s, 2), `${int(rollouts.rollouts || 0)} trajectories`, rollouts.rollouts || 0)}
      ${stat("tokens", "tokens / s", num(r.tokens_per_s, r.tokens_per_s < 10 ? 2 : 0), `${int(calls.tokens_out || 0)} generated · ${int(calls.tokens_in || 0)} prompt`, (calls.tokens_in || 0) + (calls.tokens_out || 0))}
      ${stat("reward", "reward mean", num(rollouts.reward_mean, 3), "all trajectories in range", rollouts.reward_mean ?? "")}
      ${stat("settle", "finish → trajectory", ms(settle.p50_ms), `p99 ${ms(settle.p99_ms)}`, settle.p50_ms ?? "")}
      ${stat("lag", "streams lag", o.lag.error ? "–" : int(lagTotal), o.lag.error ? "no consumer group yet" : "records not yet processed", o.lag.error ? "" : lagTotal)}
    </div>
    <div class="grid">
      <div class="card span7"><h2>Reward by weight version</h2><div id="chart-reward"></div>
        ${panelError(o.reward)}
        ${table(o.reward.rows, [
          { key: "weight_version", label: "version", num: true }, { key: "split", label: "split", fmt: badge },
          { key: "trajectories", label: "trajectories", num: true, fmt: int }, { key: "reward_mean", label: "reward mean", num: true, fmt: (v) => num(v, 3) },
          { key: "pass_rate", label: "pass rate (reward ≥ 1)", num: true, fmt: pct }, { key: "reward_missing", label: "missing", num: true, fmt: int }])}
        ${sqlBlock(o.sql.reward)}</div>
      <div class="card span5"><h2>Live</h2><div id="feed" class="feed">${feedHtml()}</div></div>
      <div class="card span7"><h2>Flagged gradings by weight version</h2>${panelError(o.flagged)}
        ${table(o.flagged.rows, [
          { key: "weight_version", label: "version", num: true }, { key: "graded", label: "graded", num: true, fmt: int },
          { key: "flagged", label: "flagged", num: true, fmt: int }, { key: "flagged_rate", label: "flagged rate", num: true, fmt: pct },
          { key: "tests_passed", label: "tests passed", num: true, fmt: int }, { key: "penalized", label: "paid 0 by policy", num: true, fmt: int },
          { key: "reward_mean", label: "reward mean", num: true, fmt: (v) => num(v, 3) }], "no graded diff in this range")}
        ${sqlBlock(o.sql.flagged)}</div>
      <div class="card span7"><h2>Latency by upstream</h2>${panelError(o.latency)}
        ${table(o.latency.rows, [
          { key: "upstream", label: "upstream", fmt: (v) => `<span class="mono">${esc(v)}</span>` }, { key: "calls", label: "calls", num: true, fmt: int },
          { key: "latency_p50_ms", label: "p50", num: true, fmt: ms }, { key: "latency_p99_ms", label: "p99", num: true, fmt: ms },
          { key: "errors", label: "errors", num: true, fmt: int }, { key: "error_rate", label: "error rate", num: true, fmt: pct }])}
        ${sqlBlock(o.sql.latency)}</div>
      <div class="card span5"><h2>Weight version per server</h2>
        ${table(o.servers.rows, [
          { key: "server", label: "server", fmt: (v) => `<span class="mono">${esc(v)}</span>` }, { key: "model", label: "model" },
          { key: "version", label: "version", num: true, fmt: (v) => `<b>${esc(v)}</b>` }, { key: "updated_ms", label: "since", fmt: when }], "no swap recorded yet")}
        ${sqlBlock(o.sql.servers)}</div>
      <div class="card span7"><h2>Weight swaps: how long each server paused</h2><div id="chart-swaps"></div>
        ${table(o.swaps.rows.slice(0, 8), [
          { key: "time", label: "time", fmt: clock }, { key: "version", label: "version", num: true }, { key: "server", label: "server", fmt: (v) => `<span class="mono">${esc(v)}</span>` },
          { key: "status", label: "status", fmt: badge }, { key: "pause_ms", label: "pause", num: true, fmt: ms }, { key: "load_ms", label: "load", num: true, fmt: ms },
          { key: "held_ms", label: "held", num: true, fmt: ms }], "no swap in this range")}
        ${sqlBlock(o.sql.swaps)}</div>
      <div class="card span5"><h2>Staleness of trained samples</h2>
        ${table(o.staleness.rows, [
          { key: "trained_into", label: "trained into", num: true }, { key: "staleness", label: "versions behind", num: true },
          { key: "samples", label: "samples", num: true, fmt: int }, { key: "reward_mean", label: "reward mean", num: true, fmt: (v) => num(v, 3) }],
          "no version trained on trajectories of this range")}
        ${sqlBlock(o.sql.staleness)}
        <h3>Streams lag</h3>
        ${o.lag.error ? `<div class="empty">group ${esc(o.lag.group)}: ${esc(o.lag.error)}</div>` :
          table(Object.entries(o.lag.topics).map(([topic, n]) => ({ topic, n })), [{ key: "topic", label: "input topic" }, { key: "n", label: "records behind", num: true, fmt: int }])}
      </div>
    </div>`;
}

function drawOverviewCharts() {
  const o = state.overview;
  if (!o) return;
  const series = [];
  for (const [split, color] of [["train", "#5fb3ff"], ["validation", "#c792ea"]]) {
    const rows = o.reward.rows.filter((r) => r.split === split && r.weight_version !== null);
    if (!rows.length) continue;
    series.push({ name: `${split} reward`, color, points: rows.map((r) => [r.weight_version, r.reward_mean]) });
    series.push({ name: `${split} pass rate`, color, dashed: true, points: rows.map((r) => [r.weight_version, r.pass_rate]) });
  }
  Charts.line($("#chart-reward"), series, { xName: "version", xFmt: (v) => `v${v}`, yFmt: (v) => v.toFixed(2), xMinStep: 1 });
  Charts.bars($("#chart-swaps"), o.swaps.rows.map((s) => ({
    t: s.time, v: s.pause_ms, color: s.status === "ok" ? versionColor(s.version) : "#f06a6a",
    label: `v${s.version} on ${s.server}: paused ${ms(s.pause_ms)} (${s.status})`,
  })), { yFmt: (v) => `${v.toFixed(0)} ms` });
}

// --- rollouts ----------------------------------------------------------------------------------

const STATUSES = ["finished", "failed", "timed_out", "abandoned"];

function filtersHtml(p) {
  const statuses = p.getAll("status");
  return `
    <form id="filters" class="filters card">
      <label>search<input name="q" placeholder="rollout, attempt, task or group id" value="${esc(p.get("q") || "")}" size="28"></label>
      <label>task<input name="task" value="${esc(p.get("task") || "")}" size="14"></label>
      <div><div class="muted" style="font-size:12px">status</div><div class="statuses">${STATUSES.map((s) =>
        `<label><input type="checkbox" name="status" value="${s}" ${statuses.includes(s) ? "checked" : ""}>${s.replace("_", " ")}</label>`).join("")}</div></div>
      <label>split<select name="split"><option value="">any</option>${["train", "validation"].map((s) => `<option ${p.get("split") === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      <label>reward ≥<input name="reward_min" type="number" step="any" value="${esc(p.get("reward_min") || "")}"></label>
      <label>reward ≤<input name="reward_max" type="number" step="any" value="${esc(p.get("reward_max") || "")}"></label>
      <label>version<input name="version" type="number" value="${esc(p.get("version") || "")}"></label>
      <label>since<input name="since" value="${esc(p.get("since") || state.range)}" size="8" title="an age (15m, 2h, 3d), ISO time, epoch ms, or all"></label>
      <label>until<input name="until" value="${esc(p.get("until") || "")}" size="8" placeholder="now"></label>
      <label style="flex:1">where (SQL)<input name="where" value="${esc(p.get("where") || "")}" placeholder="reward > 0.5 AND duration_ms < 60000"></label>
      <button type="submit">Search</button>
    </form>`;
}

function bindFilters() {
  const form = $("#filters");
  if (!form) return;
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form).entries()) if (String(v).trim() !== "") q.append(k, String(v).trim());
    state.cursors = [];
    const next = `#/rollouts?${q}`;
    if (location.hash === next) render(); else location.hash = next;
  });
  $("#older")?.addEventListener("click", () => {
    const p = parseRoute().params;
    state.cursors.push(p.get("cursor") || "");
    p.set("cursor", $("#older").dataset.cursor);
    location.hash = `#/rollouts?${p}`;
  });
  $("#newer")?.addEventListener("click", () => {
    const p = parseRoute().params;
    const previous = state.cursors.pop();
    if (previous) p.set("cursor", previous); else p.delete("cursor");
    location.hash = `#/rollouts?${p}`;
  });
  document.querySelectorAll("tr.link").forEach((tr) => tr.addEventListener("click", (e) => {
    if (e.target.tagName !== "A") location.hash = tr.dataset.href;
  }));
}

async function renderRollouts(route) {
  const p = route.params;
  const params = {};
  for (const k of ["q", "task", "split", "reward_min", "reward_max", "version", "where", "until", "cursor"]) params[k] = p.get(k);
  params.status = p.getAll("status");
  params.since = p.get("since") || state.range;
  params.limit = 50;
  const page = await api("/api/rollouts", params);
  const rows = page.rows.map((r) => {
    const href = rolloutHref(r.rollout_id, { partition: r.kafka_partition, offset: r.kafka_offset, attempt_id: r.attempt_id });
    const reward = r.reward === null ? '<span class="muted">–</span>' :
      `<span class="bar" style="width:${Math.max(2, Math.min(1, Math.max(0, r.reward)) * 50)}px"></span>${num(r.reward, 3)}`;
    return `<tr class="link" data-href="${href}" data-rollout="${esc(r.rollout_id)}">
      <td>${when(r.finished_at)}</td><td><a class="mono" href="${href}">${esc(short(r.rollout_id))}</a></td>
      <td class="mono">${esc(r.task_id ?? "–")}</td><td>${badge(r.status)}</td><td>${badge(r.split)}</td>
      <td class="num">${r.weight_version_launch ?? "–"}</td><td class="num">${reward}</td>
      <td class="num">${ms(r.duration_ms)}</td><td class="num">${r.attempt_number ?? ""}</td></tr>`;
  }).join("");
  const body = page.rows.length ? `<table id="rollouts"><thead><tr><th>finished</th><th>rollout</th><th>task</th><th>status</th><th>split</th>
      <th class="num">version</th><th class="num">reward</th><th class="num">duration</th><th class="num">attempt</th></tr></thead><tbody>${rows}</tbody></table>`
    : '<div class="empty">no rollout matches in this range</div>';
  return `<h1>Rollouts</h1>${filtersHtml(p)}
    <div class="card">${body}
      <div class="pager"><button id="newer" class="ghost" ${p.get("cursor") ? "" : "disabled"}>← newer</button>
        <button id="older" class="ghost" ${page.next_cursor ? "" : "disabled"} data-cursor="${esc(page.next_cursor || "")}">older →</button>
        <span id="scan-info">${page.rows.length} shown · read ${int(page.scanned)} records in ${int(page.took_ms)} ms${page.complete ? "" : " · stopped at the read budget: narrow the range"}</span></div>
    </div>`;
}

// --- one rollout -------------------------------------------------------------------------------

function textOf(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map(textOf).join("\n");
  if (typeof content === "object") {
    if (content.text !== undefined) return content.text;
    if (content.type === "tool_use") return `→ ${content.name}(${JSON.stringify(content.input)})`;
    if (content.type === "tool_result") return textOf(content.content);
    if (content.type === "function_call") return `→ ${content.name}(${content.arguments})`;
    if (content.type === "function_call_output" || content.type === "custom_tool_call_output") return textOf(content.output);
    if (content.type === "custom_tool_call") return `→ ${content.name}: ${content.input}`;
    if (content.content !== undefined) return textOf(content.content);
  }
  return JSON.stringify(content);
}

function chatMessage(m) {
  let text = textOf(m.content);
  if (m.tool_calls) text += (text ? "\n" : "") + m.tool_calls.map((c) => `→ ${c.function?.name}(${c.function?.arguments})`).join("\n");
  return { role: m.role || m.type || "message", text };
}

// the prompt and the reply of one call, whatever the API it used
function exchange(call) {
  const req = call.data.request || {}, res = call.data.response || {};
  let prompt = [], reply = [];
  if (call.data.api === "chat.completions") {
    prompt = (req.messages || []).map(chatMessage);
    reply = (res.choices || []).slice(0, 1).map((c) => chatMessage(c.message || {}));
  } else if (call.data.api === "completions") {
    prompt = [{ role: "prompt", text: textOf(req.prompt) }];
    reply = (res.choices || []).slice(0, 1).map((c) => ({ role: "assistant", text: c.text }));
  } else if (call.data.api === "responses") {
    if (req.instructions) prompt.push({ role: "system", text: req.instructions });
    const input = typeof req.input === "string" ? [{ role: "user", content: req.input }] : req.input || [];
    prompt.push(...input.map((i) => ({ role: i.role || (i.type?.endsWith("output") ? "tool" : "assistant"), text: textOf(i.content ?? i) })));
    reply = (res.output || []).map((o) => ({ role: "assistant", text: textOf(o.content ?? o) }));
  } else if (call.data.api === "messages") {
    if (req.system) prompt.push({ role: "system", text: textOf(req.system) });
    prompt.push(...(req.messages || []).map((m) => ({ role: m.role, text: textOf(m.content) })));
    reply = [{ role: "assistant", text: textOf(res.content) }];
  }
  return { prompt, reply };
}

function conversationHtml(d) {
  const calls = new Map(d.calls.map((c) => [c.id, c]));
  const turns = d.trajectory.data.turns;
  if (!turns.length) return '<div class="empty">this attempt made no model call</div>';
  let seen = [];
  return turns.map((turn, i) => {
    const call = calls.get(turn.call_id);
    const head = `<div class="turn-head">turn ${i + 1} · ${turn.completion_token_ids.length} tokens generated by version ${turn.weight_version ?? "–"} · ${ms(turn.latency_ms)}${turn.reward !== null && turn.reward !== undefined ? ` · turn reward ${num(turn.reward, 3)}` : ""}</div>`;
    if (!call) return head + '<div class="empty">the call event is outside the range read</div>';
    const { prompt, reply } = exchange(call);
    let same = 0;
    while (same < prompt.length && same < seen.length && prompt[same].role === seen[same].role && prompt[same].text === seen[same].text) same++;
    const fresh = prompt.slice(same);
    seen = [...prompt, ...reply];
    const msg = (m) => `<div class="msg ${esc(m.role)}"><div class="role">${esc(m.role)}</div><pre>${esc(m.text)}</pre></div>`;
    return head + fresh.map(msg).join("") + reply.map(msg).join("");
  }).join("");
}

function tokensHtml(d) {
  const t = d.trajectory.data;
  const versions = [...new Set(t.sequences.flatMap((s) => s.weight_versions.filter((v, i) => s.mask[i])))];
  const generated = t.sequences.reduce((a, s) => a + s.mask.reduce((x, y) => x + y, 0), 0);
  const legend = `<div class="legend">
      <span><span class="swatch" style="background:#1a212b;border:1px solid #334"></span>prompt / environment (mask 0)</span>
      <span>generated (mask 1), by probability: <span class="scale" style="background:linear-gradient(90deg,hsl(0,70%,60%),hsl(60,70%,60%),hsl(120,55%,60%))"></span> 0 → 1</span>
      <span>weight version (underline): ${versions.map((v) => `<span><span class="swatch" style="background:${versionColor(v)}"></span>v${v ?? "–"}</span>`).join(" ")}</span>
    </div>`;
  const seqs = t.sequences.map((s, k) => {
    const gen = s.mask.reduce((a, b) => a + b, 0);
    const limit = 20000;
    const spans = s.token_ids.slice(0, limit).map((id, i) => {
      if (!s.mask[i]) return `<span class="tok prompt" title="token ${id} · prompt/environment">${id}</span>`;
      const lp = s.logprobs[i], p = Math.exp(lp), v = s.weight_versions[i];
      return `<span class="tok gen" data-v="${v ?? ""}" style="background:hsl(${(p * 120).toFixed(0)},${p > 0.5 ? 55 : 70}%,60%);border-bottom-color:${versionColor(v)}" title="token ${id} · logprob ${lp.toFixed(3)} (p ${p.toFixed(3)}) · version ${v ?? "–"}">${id}</span>`;
    }).join("");
    const more = s.token_ids.length > limit ? `<div class="muted">… ${int(s.token_ids.length - limit)} more tokens not drawn</div>` : "";
    return `<h3>sequence ${k + 1} · ${int(s.token_ids.length)} tokens · <span data-seq-generated="${gen}">${int(gen)} generated</span> · turns ${s.turns.map((x) => x + 1).join(", ")}</h3><div class="tokens">${spans}</div>${more}`;
  }).join("");
  return `<div><b data-generated="${generated}">${int(generated)} generated tokens</b> in ${t.sequences.length} sequence(s)${t.merged ? "" : ` · ${t.merge_mismatches} turn(s) did not extend the previous prompt`}</div>${legend}${seqs || '<div class="empty">no tokens</div>'}`;
}

function detailsHtml(details) {
  const entries = Object.entries(details || {});
  if (!entries.length) return '<div class="muted">no details</div>';
  return `<dl class="kv">${entries.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${typeof v === "object" && v !== null
    ? `<pre class="tail">${esc(JSON.stringify(v, null, 2))}</pre>` : `<span class="mono">${esc(v)}</span>`}</dd>`).join("")}</dl>`;
}

function rewardsHtml(d) {
  const t = d.trajectory.data;
  const top = `<div class="stats">${stat("final-reward", "final reward", num(t.reward, 3), t.reward_missing ? "expected, never came" : `${t.rewards.length} reward(s)`, t.reward ?? "")}</div>`;
  if (!d.rewards.length) return top + '<div class="empty">no reward event for this attempt</div>';
  return top + d.rewards.map((r) => `<div class="card" style="margin-bottom:10px">
      <h2>${num(r.data.value, 3)} <span class="muted" style="font-weight:400">· ${esc(r.data.reward_fn || "posted by the agent")} · ${when(r.time)}</span></h2>
      ${r.data.turns.length ? `<div class="muted">per turn: ${r.data.turns.map((x) => `${x.call_id ? esc(short(x.call_id)) : `turn ${x.turn + 1}`} = ${num(x.value, 3)}`).join(", ")}</div>` : ""}
      ${detailsHtml(r.data.details)}</div>`).join("");
}

function lifecycleHtml(d) {
  const events = d.rollout_events;
  if (!events.length) return '<div class="empty">no lifecycle event near this attempt</div>';
  const mine = d.trajectory.attempt_id;
  const rows = events.map((e) => {
    const x = e.data, facts = [];
    if (x.worker) facts.push(`${esc(x.launcher)} worker ${esc(x.worker)}`);
    if (x.exit_code !== undefined && x.exit_code !== null) facts.push(`exit ${x.exit_code}`);
    if (x.duration_ms) facts.push(ms(x.duration_ms));
    if (x.elapsed_ms) facts.push(`${ms(x.elapsed_ms)} in`);
    if (x.error) facts.push(`<span class="error">${esc(x.error)}</span>`);
    if (x.will_retry) facts.push("will retry");
    if (x.task) facts.push(`task ${esc(x.task.id)} · ${esc(x.split)} · launched on v${x.weight_version ?? "–"}`);
    const tails = ["stdout_tail", "stderr_tail"].filter((k) => x[k]).map((k) => `<div class="muted">${k.replace("_tail", "")}</div><pre class="tail">${esc(x[k])}</pre>`).join("");
    return `<tr${e.attempt_id === mine ? "" : ' class="muted"'}><td>${clock(e.time)}</td><td>${esc(e.type.replace("rollout.", ""))}</td><td class="mono">${esc(short(e.attempt_id))}</td><td style="white-space:normal">${facts.join(" · ")}${tails}</td></tr>`;
  }).join("");
  return `<table><thead><tr><th>time</th><th>event</th><th>attempt</th><th>what</th></tr></thead><tbody>${rows}</tbody></table>`;
}

function lineageHtml(d) {
  const t = d.trajectory.data;
  const trained = d.trained_by.length
    ? d.trained_by.map((w) => `<li>trained into <b>version ${w.version}</b>${w.base_version !== undefined ? ` (from v${w.base_version}, step ${w.step}, ${int(w.samples)} samples, ${when(w.time)})` : ""}</li>`).join("")
    : "<li>no weight version has trained on it (yet)</li>";
  const turnVersions = [...new Set(t.turns.map((x) => x.weight_version))];
  return `<ul data-trained-by="${d.trained_by.map((w) => w.version).join(",")}">${trained}</ul>
    <dl class="kv"><dt>launched on</dt><dd>version ${t.weight_version_launch ?? "–"}</dd>
      <dt>tokens generated by</dt><dd>${turnVersions.map((v) => `v${v ?? "–"}`).join(", ") || "–"}</dd>
      <dt>trajectory event</dt><dd class="mono">${esc(d.trajectory.id)}</dd>
      <dt>built from</dt><dd>${t.lineage.length} events<details class="sql"><summary>ids</summary><pre>${esc(t.lineage.join("\n"))}</pre></details></dd></dl>`;
}

let current = null;
async function renderRollout(route) {
  const d = await api(`/api/rollouts/${encodeURIComponent(route.arg)}`, { partition: route.params.get("p"), offset: route.params.get("o"), attempt: route.params.get("attempt") });
  current = d;
  const t = d.trajectory.data;
  const attempts = d.attempts.length > 1 ? `<label class="muted">attempt <select id="attempt">${d.attempts.map((a) =>
    `<option value="${esc(a.attempt_id)}" ${a.attempt_id === d.trajectory.attempt_id ? "selected" : ""}>#${a.attempt_number} ${esc(a.status)} ${num(a.reward, 2)}</option>`).join("")}</select></label>` : "";
  const tab = route.params.get("tab") || "conversation";
  const tabs = ["conversation", "tokens", "rewards", "lifecycle", "lineage"];
  return `<h1>Rollout <span class="mono">${esc(d.trajectory.rollout_id)}</span> ${badge(t.status)} ${badge(t.split)} ${attempts}</h1>
    <div class="stats">
      ${stat("task", "task", `<span class="mono" style="font-size:16px">${esc(t.task_id ?? "–")}</span>`, `group ${esc(short(t.group_id))} · sample ${t.sample_index}`)}
      ${stat("reward", "reward", num(t.reward, 3), t.reward_missing ? "missing" : `${t.rewards.length} reward event(s)`, t.reward ?? "")}
      ${stat("version", "launched on", `v${t.weight_version_launch ?? "–"}`, esc(t.model || ""))}
      ${stat("turns", "turns", int(t.turns.length), `${t.sequences.length} sequence(s)`)}
      ${stat("duration", "duration", ms(t.duration_ms), `finished ${when(t.finished_at)}`)}
    </div>
    <div class="tabs">${tabs.map((name) => `<button data-tab="${name}" class="${name === tab ? "active" : ""}">${name}</button>`).join("")}</div>
    <div id="tab-body" class="card">${tabBody(tab, d)}</div>`;
}

function tabBody(tab, d) {
  return ({ conversation: conversationHtml, tokens: tokensHtml, rewards: rewardsHtml, lifecycle: lifecycleHtml, lineage: lineageHtml }[tab] || conversationHtml)(d);
}

function bindTabs() {
  document.querySelectorAll(".tabs button").forEach((b) => b.addEventListener("click", () => {
    document.querySelectorAll(".tabs button").forEach((x) => x.classList.toggle("active", x === b));
    $("#tab-body").innerHTML = tabBody(b.dataset.tab, current);
    const p = parseRoute().params;
    p.set("tab", b.dataset.tab);
    history.replaceState(null, "", `#/rollout/${encodeURIComponent(parseRoute().arg)}?${p}`);
  }));
  $("#attempt")?.addEventListener("change", (e) => {
    location.hash = `#/rollout/${encodeURIComponent(current.trajectory.rollout_id)}?attempt=${encodeURIComponent(e.target.value)}`;
  });
}

// --- compare -----------------------------------------------------------------------------------

async function renderCompare(route) {
  const p = route.params;
  const a = p.get("a"), b = p.get("b"), split = p.get("split") || "";
  const form = `<form id="compare" class="filters card">
      <label>version A<input name="a" type="number" value="${esc(a ?? "")}" required></label>
      <label>version B<input name="b" type="number" value="${esc(b ?? "")}" required></label>
      <label>split<select name="split"><option value="">any</option>${["train", "validation"].map((s) => `<option ${split === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      <button type="submit">Compare</button><span class="muted">on the tasks both versions were launched on, within the range</span></form>`;
  if (a === null || b === null) return `<h1>Compare weight versions</h1>${form}`;
  const c = await api("/api/compare", { a, b, split, since: state.range });
  const delta = (x, y, f) => (x === null || y === null ? "" : `<span class="delta ${y > x ? "up" : y < x ? "down" : ""}">${y >= x ? "+" : ""}${f(y - x)}</span>`);
  const rows = c.tasks.map((t) => `<tr><td class="mono">${esc(t.task_id)}</td>
      <td class="num">${int(t.a.attempts)} / ${int(t.b.attempts)}</td>
      <td class="num">${num(t.a.reward_mean, 3)}</td><td class="num">${num(t.b.reward_mean, 3)}</td><td class="num">${delta(t.a.reward_mean, t.b.reward_mean, (v) => num(v, 3))}</td>
      <td class="num">${pct(t.a.pass_rate)}</td><td class="num">${pct(t.b.pass_rate)}</td>
      <td class="num">${num(t.a.length_mean, 0)}</td><td class="num">${num(t.b.length_mean, 0)}</td></tr>`).join("");
  const T = c.totals;
  return `<h1>Compare v${c.a} and v${c.b}</h1>${form}
    ${c.error ? `<div class="banner">${esc(c.error)}</div>` : ""}
    <div class="stats">
      ${stat("reward-a", `reward v${c.a}`, num(T.a.reward_mean, 3), `${int(T.a.attempts)} attempts`, T.a.reward_mean ?? "")}
      ${stat("reward-b", `reward v${c.b}`, num(T.b.reward_mean, 3), `${int(T.b.attempts)} attempts`, T.b.reward_mean ?? "")}
      ${stat("pass", "pass rate", `${pct(T.a.pass_rate)} → ${pct(T.b.pass_rate)}`, "reward ≥ 1")}
      ${stat("length", "generated tokens / attempt", `${num(T.a.length_mean, 0)} → ${num(T.b.length_mean, 0)}`, "mean")}
      ${stat("tasks", "shared tasks", int(c.tasks.length), `${c.only_a} only in v${c.a} · ${c.only_b} only in v${c.b}`, c.tasks.length)}
    </div>
    <div class="card">${c.tasks.length ? `<table id="compare-table"><thead><tr><th>task</th><th class="num">attempts</th>
      <th class="num">reward v${c.a}</th><th class="num">reward v${c.b}</th><th class="num">Δ</th><th class="num">pass v${c.a}</th><th class="num">pass v${c.b}</th>
      <th class="num">length v${c.a}</th><th class="num">length v${c.b}</th></tr></thead><tbody>${rows}</tbody></table>`
      : '<div class="empty">no task was run by both versions in this range</div>'}${sqlBlock(c.sql)}</div>`;
}

function bindCompare() {
  $("#compare")?.addEventListener("submit", (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(e.target).entries()) if (String(v) !== "") q.set(k, v);
    location.hash = `#/compare?${q}`;
  });
}

// --- canaries ----------------------------------------------------------------------------------

async function renderCanaries() {
  const { releases } = await api("/api/releases");
  if (!releases.length) return '<h1>Canaries</h1><div class="empty">no canary in the log (the gateway starts one per new version when --canary-share is above 0)</div>';
  const cards = releases.map((r) => {
    const arms = r.arms.length ? r.arms : [{ version: r.stable_version }, { version: r.version }];
    const rows = arms.map((a, i) => `<tr data-arm="${i ? "canary" : "stable"}"><td>${i ? "canary" : "stable"} <b>v${esc(a.version)}</b></td>
      <td class="num">${int(a.sessions)}</td><td class="num">${num(a.mean_reward, 3)}</td><td class="num">${num(a.reward_std, 3)}</td>
      <td class="num">${int(a.calls)}</td><td class="num">${a.calls ? pct(a.errors / a.calls) : "–"}</td><td class="num">${ms(a.p95_latency_ms)}</td></tr>`).join("");
    const name = r.tenant ? `${r.model} · tenant ${r.tenant}` : r.model;  // a tenant's adapters: its own card
    return `<div class="card" data-canary="${esc(r.model)}" data-tenant="${esc(r.tenant || "")}"><h2>${esc(name)}: v${esc(r.stable_version)} → v${esc(r.version)} ${badge(r.phase)}</h2>
      <p class="muted">${pct(r.share)} of sessions on ${esc(r.servers.join(", "))} since ${when(r.started_at)}${r.decided_by ? ` · decided by ${esc(r.decided_by)} at ${when(r.decided_at)}` : ""}</p>
      <table><thead><tr><th>arm</th><th class="num">sessions</th><th class="num">mean reward</th><th class="num">std</th><th class="num">calls</th><th class="num">errors</th><th class="num">p95 latency</th></tr></thead><tbody>${rows}</tbody></table>
      <p>one-sided p <b data-p>${num(r.p_value, 4)}</b> · ${esc(r.reason || "waiting for the decision service")}</p></div>`;
  });
  return `<h1>Canaries</h1>${cards.join("")}`;
}

// --- start -------------------------------------------------------------------------------------

if (!state.key) showLogin();
else { connectLive(); render(); }
