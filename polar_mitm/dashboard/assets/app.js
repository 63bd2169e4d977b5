// polar-mitm dashboard: a hash-routed page over the JSON routes of routes.py, kept live by server-sent events.
// Everything shown comes from the run (prompts, answers, task ids are hostile): the DOM is built with
// createElement + textContent only — never innerHTML with data.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const state = { page: "", params: new URLSearchParams(), loads: 0 };

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "style") node.style.cssText = value; // CSSOM: allowed by the page's CSP, unlike a style attribute
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function s(tag, attrs, ...children) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
  return response.json();
}

const fmt = {
  num(v, digits = 3) { return v === null || v === undefined ? "—" : Number(v).toFixed(digits).replace(/\.?0+$/, "") || "0"; },
  int(v) { return v === null || v === undefined ? "—" : String(Math.round(v)); },
  secs(v) { return v === null || v === undefined ? "—" : `${Number(v).toFixed(1)}s`; },
  time(v) { return v ? new Date(v * 1000).toISOString().replace("T", " ").slice(0, 19) : "—"; },
  text(v) { return v === null || v === undefined || v === "" ? "—" : String(v); },
};

function table(columns, rows, opts = {}) {
  const head = h("tr", {}, columns.map(c => {
    const th = h("th", { class: [c.num ? "num" : "", opts.sort ? "sortable" : "", opts.sort && opts.sort.key === c.key ? "sorted" : "", opts.sort && opts.sort.key === c.key && opts.sort.desc ? "desc" : ""].join(" "), dataset: { key: c.key } }, c.label);
    if (opts.sort && c.sortable !== false) th.addEventListener("click", () => opts.onSort(c.key));
    return th;
  }));
  const body = rows.map(row => {
    const tr = h("tr", { class: opts.onRow ? "link" : "" }, columns.map(c => h("td", { class: c.num ? "num" : "" }, c.cell ? c.cell(row) : fmt.text(row[c.key]))));
    if (opts.onRow) tr.addEventListener("click", () => opts.onRow(row));
    if (opts.rowData) Object.assign(tr.dataset, opts.rowData(row));
    return tr;
  });
  return h("table", { id: opts.id }, h("thead", {}, head), h("tbody", {}, body));
}

function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, fmt.text(v))]));
}

// -- curves (inline SVG) ------------------------------------------------------------------------------------
function lineChart(title, series, opts = {}) {
  const width = 340, height = 170, pad = { l: 42, r: 10, t: 10, b: 24 };
  const points = series.flatMap(ser => ser.points.filter(p => p[1] !== null && p[1] !== undefined));
  const box = h("div", { class: "chart", id: opts.id }, h("div", { class: "title" }, title));
  if (!points.length) { box.append(h("div", { class: "muted" }, "no data yet")); return box; }
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(0, ...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + 1;
  const X = x => pad.l + (x - x0) / (x1 - x0) * (width - pad.l - pad.r);
  const Y = y => height - pad.b - (y - y0) / (y1 - y0) * (height - pad.t - pad.b);
  const svg = s("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
  svg.append(s("line", { x1: pad.l, y1: Y(y0), x2: width - pad.r, y2: Y(y0), stroke: "#9ca3af" }));
  svg.append(s("line", { x1: pad.l, y1: pad.t, x2: pad.l, y2: height - pad.b, stroke: "#9ca3af" }));
  for (const y of [y0, (y0 + y1) / 2, y1]) svg.append(s("text", { x: pad.l - 4, y: Y(y) + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7280" }, fmt.num(y, 2)));
  for (const x of [...new Set(xs)]) svg.append(s("text", { x: X(x), y: height - 8, "text-anchor": "middle", "font-size": 10, fill: "#6b7280" }, String(x)));
  const colours = ["#2563eb", "#dc2626", "#16a34a", "#9333ea"];
  series.forEach((ser, i) => {
    const pts = ser.points.filter(p => p[1] !== null && p[1] !== undefined);
    if (!pts.length) return;
    // Later series dashed, so one lying on another (reward mean = pass rate for 0/1 rewards) still shows.
    svg.append(s("path", { d: pts.map((p, j) => `${j ? "L" : "M"}${X(p[0])},${Y(p[1])}`).join(" "), fill: "none", stroke: colours[i % 4], "stroke-width": 2, "stroke-dasharray": i ? "6 4" : "none" }));
    for (const p of pts) { const dot = s("circle", { cx: X(p[0]), cy: Y(p[1]), r: 3, fill: colours[i % 4] }); dot.append(s("title", {}, `${ser.label} @ ${p[0]}: ${fmt.num(p[1])}`)); svg.append(dot); }
  });
  box.append(svg, h("div", { class: "legend" }, series.map((ser, i) => h("span", { style: `color:${colours[i % 4]};margin-right:1em` }, `■ ${ser.label}`))));
  return box;
}

// -- pages -------------------------------------------------------------------------------------------------
const pages = {};

pages.overview = async () => {
  const data = await api("/api/overview");
  const its = data.iterations;
  const ks = [...new Set(its.flatMap(r => Object.keys(r.pass_at || {})))];
  const at = key => its.map(r => [r.iteration, r[key]]);
  const out = [h("h2", {}, "Run"), facts([["folder", data.run_dir], ["tasks", data.settings.tasks], ["model", data.settings.model], ["harness", data.settings.harness], ["iterations asked", data.settings.iterations], ["group size", data.settings.group_size], ["state", data.finished ? "finished" : (data.running.length ? data.running.map(r => `${r.stage}: ${r.running}`).join(", ") : "—")]])];
  out.push(h("h2", {}, "Curves"), h("div", { class: "charts" },
    lineChart("reward and pass rate", [{ label: "reward mean", points: at("reward_mean") }, { label: "pass rate", points: at("pass_rate") }], { id: "chart-reward" }),
    lineChart("held-out pass@k", ks.map(k => ({ label: k, points: its.map(r => [r.iteration, (r.pass_at || {})[k]]) })), { id: "chart-eval" }),
    lineChart("KL and clip ratio", [{ label: "KL", points: at("kl") }, { label: "clip ratio", points: at("clip_ratio") }, { label: "clip fraction", points: at("clip_fraction") }], { id: "chart-kl" }),
    lineChart("staleness (updates behind)", [{ label: "mean staleness", points: at("staleness") }], { id: "chart-staleness" }),
    lineChart("tokens", [{ label: "trainable", points: at("trainable_tokens") }, { label: "total", points: at("total_tokens") }], { id: "chart-tokens" })));
  const stagesSeen = [...new Set(its.flatMap(r => Object.keys(r.seconds || {})))];
  const columns = [
    { key: "iteration", label: "iter", num: true }, { key: "weight_version", label: "weights" },
    { key: "sessions", label: "sessions", num: true }, { key: "reward_mean", label: "reward", num: true, cell: r => fmt.num(r.reward_mean) },
    { key: "pass_rate", label: "pass rate", num: true, cell: r => fmt.num(r.pass_rate) },
    ...ks.map(k => ({ key: k, label: `held-out ${k}`, num: true, cell: r => fmt.num((r.pass_at || {})[k]) })),
    { key: "kl", label: "KL", num: true, cell: r => fmt.num(r.kl, 4) }, { key: "clip_fraction", label: "clip", num: true, cell: r => fmt.num(r.clip_fraction ?? r.clip_ratio, 4) },
    { key: "staleness", label: "staleness", num: true, cell: r => fmt.num(r.staleness, 2) },
    ...(its.some(r => r.masked_tokens !== null && r.masked_tokens !== undefined) ? [{ key: "masked_tokens", label: "stale tokens masked", num: true, cell: r => fmt.int(r.masked_tokens) }] : []),
    { key: "groups", label: "groups (flat)", num: true, cell: r => `${r.groups} (${r.uninformative_groups})` },
    { key: "trainable_tokens", label: "tokens trained / all", num: true, cell: r => `${r.trainable_tokens} / ${r.total_tokens}` },
    ...stagesSeen.map(st => ({ key: `s-${st}`, label: `${st} s`, num: true, cell: r => fmt.num((r.seconds || {})[st], 1) })),
    { key: "train_skipped", label: "trained", cell: r => r.train_skipped ? "skipped (all flat)" : "yes" },
  ];
  out.push(h("h2", {}, `Iterations (${its.length})`), table(columns, its, { id: "iterations", rowData: r => ({ iteration: r.iteration }) }));
  return out;
};

const SESSION_COLUMNS = [
  { key: "stage", label: "stage" }, { key: "session_id", label: "session" }, { key: "task_id", label: "task" },
  { key: "harness", label: "harness" }, { key: "status", label: "status" }, { key: "end", label: "end" }, { key: "finish_reason", label: "finish" },
  { key: "reward", label: "reward", num: true, cell: r => fmt.num(r.reward) },
  { key: "judge_score", label: "judge", num: true, cell: r => r.judge_mode ? `${fmt.num(r.judge_score)} (${r.judge_mode}; check ${fmt.num(r.outcome)})` : "—" },
  { key: "calls", label: "calls", num: true },
  { key: "prompt_tokens", label: "prompt tok", num: true }, { key: "completion_tokens", label: "sampled tok", num: true },
  { key: "init_seconds", label: "init", num: true, cell: r => fmt.secs(r.init_seconds) }, { key: "run_seconds", label: "run", num: true, cell: r => fmt.secs(r.run_seconds) },
  { key: "eval_seconds", label: "eval", num: true, cell: r => fmt.secs(r.eval_seconds) }, { key: "weight_versions", label: "weights" },
  { key: "started_at", label: "started", cell: r => fmt.time(r.started_at) },
];
const FILTER_NAMES = ["stage", "task_id", "harness", "status", "end", "finish_reason", "judge_mode"];

function go(page, params) { const q = params && params.toString(); location.hash = `#/${page}${q ? "?" + q : ""}`; }

pages.sessions = async () => {
  const p = new URLSearchParams(state.params);
  if (!p.get("limit")) p.set("limit", "50");
  const data = await api(`/api/sessions?${p}`);
  const change = (key, value) => { const next = new URLSearchParams(state.params); if (value === "" || value === null) next.delete(key); else next.set(key, value); if (key !== "offset") next.delete("offset"); go("sessions", next); };
  const search = h("input", { type: "search", id: "search", placeholder: "search prompts and answers…", value: p.get("q") || "" });
  search.addEventListener("keydown", e => { if (e.key === "Enter") change("q", search.value.trim()); });
  const selects = FILTER_NAMES.map(name => {
    const select = h("select", { id: `filter-${name}` }, h("option", { value: "" }, `${name}: all`), (data.facets[name] || []).map(v => h("option", { value: v, selected: p.get(name) === String(v) }, String(v))));
    select.addEventListener("change", () => change(name, select.value));
    return select;
  });
  const offset = data.offset, end = Math.min(offset + data.limit, data.total);
  const pager = h("div", { class: "pager" },
    h("button", { id: "prev", disabled: offset <= 0, onclick: () => change("offset", Math.max(0, offset - data.limit)) }, "← previous"),
    h("span", { id: "page-info" }, `${data.total ? offset + 1 : 0}–${end} of ${data.total} (of ${data.sessions} sessions)`),
    h("button", { id: "next", disabled: end >= data.total, onclick: () => change("offset", offset + data.limit) }, "next →"));
  const sort = { key: p.get("sort") || "started_at", desc: p.get("desc") === "1" };
  const onSort = key => { const next = new URLSearchParams(state.params); next.delete("offset"); if (sort.key === key) next.set("desc", sort.desc ? "0" : "1"); else { next.set("sort", key); next.set("desc", "0"); } go("sessions", next); };
  return [h("h2", {}, "Sessions"), h("div", { class: "filters" }, search, h("button", { onclick: () => change("q", search.value.trim()) }, "search"), selects), pager,
    table(SESSION_COLUMNS, data.rows, { id: "sessions", sort, onSort, onRow: r => go(`session/${encodeURIComponent(r.session_id)}`), rowData: r => ({ session: r.session_id }) })];
};

function tokenViewer(seq, id) {
  const box = h("div", { class: "tokens", id });
  seq.tokens.forEach(([text, tokenId, mask, logprob, turn], i) => {
    if (seq.elided && i === seq.elided[0]) box.append(h("span", { class: "elided" }, `… ${seq.elided[1]} prompt tokens not shown …`));
    const span = h("span", { class: `tk m${mask}${turn ? " turn" : ""}`, title: `id ${tokenId} · ${mask ? "sampled (loss mask 1)" : "context (mask 0)"}${mask ? ` · logprob ${logprob}` : ""}${turn ? ` · turn ${turn}` : ""}` }, text);
    span.style.setProperty("--shade", String(Math.min(1, Math.max(0, 1 + logprob / 10))));
    box.append(span);
  });
  const mode = h("select", {}, h("option", { value: "mask" }, "colour: loss mask"), h("option", { value: "logprob" }, "colour: logprob"));
  mode.addEventListener("change", () => box.classList.toggle("by-logprob", mode.value === "logprob"));
  return h("div", {}, h("div", { class: "legend" }, `${seq.sampled} sampled of ${seq.total} tokens · grey: context (mask 0) · green: sampled (mask 1) · hover a token for its id and logprob `, mode), box);
}

// A call's weights: one version, or each span's where a push landed mid-call ("1 → 2 at token 6").
function callVersions(c) {
  const spans = c.version_spans || [];
  if (spans.length < 2) return fmt.text(c.weight_version);
  return spans.map((sp, i) => i ? `${sp.version} at token ${sp.start}` : String(sp.version)).join(" → ");
}

function judgmentView(j) {
  return [h("h2", {}, "Judgment"), h("div", { id: "judgment" },
    facts([["mode", j.mode], ["judged", j.status], ["score (normalised)", fmt.num(j.score)], ["score as given", fmt.num(j.raw_score)], ["check's reward (outcome)", fmt.num(j.outcome)], ["reward trained", fmt.num(j.reward)], ["error", j.error || null]]),
    h("h3", {}, "Rationale"), h("pre", { class: "rationale" }, fmt.text(j.rationale)),
    j.answer ? h("details", {}, h("summary", {}, "the judge's answer as written"), h("pre", {}, j.answer)) : null)];
}

pages.session = async id => {
  const data = await api(`/api/session/${encodeURIComponent(id)}`);
  const r = data.session;
  const out = [h("p", {}, h("a", { href: "#/sessions" }, "← sessions")), h("h2", {}, `Session ${r.session_id}`),
    facts([["stage", r.stage], ["task", r.task_id], ["harness", r.harness], ["status", r.status], ["end", r.end], ["reward", fmt.num(r.reward)], ["calls", r.calls], ["finish reason (last call)", r.finish_reason], ["weight versions", r.weight_versions], ["init / run / eval", `${fmt.secs(r.init_seconds)} / ${fmt.secs(r.run_seconds)} / ${fmt.secs(r.eval_seconds)}`]])];
  if (data.judgment) out.push(...judgmentView(data.judgment));
  if (!data.decoded) out.push(h("p", { class: "muted" }, "no tokenizer found: tokens shown as ids"));
  out.push(h("h2", {}, `Merged sequences (${data.merged.length})`));
  if (!data.merged.length) out.push(h("p", { class: "muted" }, "none: this session was not merged into a training sequence (see Discarded)"));
  data.merged.forEach((m, i) => out.push(h("h3", {}, `${m.sequence_id} · ${m.n_turns} turns · reward ${fmt.num(m.reward)}${m.end ? ` · ended ${m.end}` : ""} · weights ${fmt.text(m.weight_version_min)}…${fmt.text(m.weight_version_max)}`), tokenViewer(m, `merged-${i}`)));
  out.push(h("h2", {}, `Calls (${data.calls.length})`));
  data.calls.forEach((c, i) => {
    const block = h("details", { class: "call", id: `call-${c.seq}`, open: i === 0 },
      h("summary", {}, `#${c.seq} · ${fmt.text(c.call_kind)} · ${c.finish_reason} · ${c.prompt_tokens} + ${c.completion_tokens} tokens · ${fmt.secs(c.seconds)} · weights ${callVersions(c)}`),
      facts([["request id", c.request_id], ["provider / path", `${c.provider} ${c.path}`], ["model asked / used", `${fmt.text(c.model_requested)} / ${fmt.text(c.model_used)}`], ["prompt mode", `${fmt.text(c.prompt_mode)}${c.splice_reason ? " (" + c.splice_reason + ")" : ""}`], ["temperature", c.temperature], ["started", fmt.time(c.started_at)], ["error", c.error]]),
      h("h3", {}, "Tokens"), tokenViewer(c.tokens, `tokens-${c.seq}`),
      h("h3", {}, "Request as the harness sent it"), h("pre", { class: "request-sent" }, fmt.text(c.request_as_sent)),
      h("h3", {}, "Request as the engine got it"), h("pre", { class: "request-engine" }, fmt.text(c.request_as_engine_got)),
      h("h3", {}, "Answer"), h("pre", { class: "answer" }, fmt.text(c.answer)),
      h("h3", {}, "Engine"), h("pre", {}, fmt.text(c.engine_meta)));
    out.push(block);
  });
  return out;
};

pages.discarded = async () => {
  const data = await api("/api/discarded");
  const counts = {};
  data.rows.forEach(r => { counts[r.reason] = (counts[r.reason] || 0) + 1; });
  const masked = data.staleness.iterations.reduce((sum, r) => sum + (r.masked_tokens || 0), 0);
  const tags = Object.entries(counts).map(([k, v]) => h("span", { class: "tag" }, `${k}: ${v} sessions`));
  if (masked) tags.push(h("span", { class: "tag", id: "masked-tag" }, `masked for staleness: ${fmt.int(masked)} tokens`));
  const out = [h("h2", {}, `Discarded (${data.rows.length})`), h("p", { id: "reasons" }, tags)];
  out.push(table([{ key: "stage", label: "stage" }, { key: "session_id", label: "session" }, { key: "task_id", label: "task" }, { key: "reason", label: "reason" }, { key: "status", label: "status" }, { key: "end", label: "end" }, { key: "reward", label: "reward", num: true, cell: r => fmt.num(r.reward) }, { key: "detail", label: "why" }], data.rows, { id: "discarded", onRow: r => go(`session/${encodeURIComponent(r.session_id)}`) }));
  const stale = data.staleness;
  out.push(h("h2", {}, "Masked for staleness"), h("p", { class: "legend" }, stale.max_staleness === null || stale.max_staleness === undefined
    ? "no --max-staleness: no sampled token was masked for its age (the calls' staleness below)"
    : `--max-staleness ${stale.max_staleness}: sampled tokens more than ${stale.max_staleness} weight versions older than the weights trained leave the loss (staleness/masked_tokens, summed over each training's steps: a token trained in two epochs counts twice)`));
  out.push(table([{ key: "stage", label: "iteration" }, { key: "steps", label: "steps", num: true }, { key: "steps_masking", label: "steps masking", num: true }, { key: "masked_tokens", label: "tokens masked", num: true, cell: r => fmt.int(r.masked_tokens) }, { key: "trained_tokens", label: "tokens trained", num: true, cell: r => fmt.int(r.trained_tokens) }, { key: "staleness_max", label: "max staleness", num: true, cell: r => fmt.int(r.staleness_max) }, { key: "call_staleness", label: "calls by updates behind", cell: r => Object.entries(r.call_staleness).map(([k, v]) => `${k}: ${v}`).join(", ") || "—" }], stale.iterations, { id: "staleness" }));
  if (data.ends.length) out.push(h("h2", {}, "How sessions ended"), table([{ key: "stage", label: "stage" }, { key: "ends", label: "sessions by end", cell: r => Object.entries(r.ends).map(([k, v]) => `${k}: ${v}`).join(", ") }], data.ends, { id: "ends" }));
  out.push(h("h2", {}, "Merge exclusions"), table([{ key: "stage", label: "stage" }, { key: "excluded", label: "calls excluded", cell: r => JSON.stringify(r.excluded) }, { key: "breaks", label: "chain breaks", cell: r => JSON.stringify(r.breaks) }, { key: "dropped_unrewarded_sequences", label: "unrewarded sequences dropped", num: true }, { key: "problems", label: "problems", cell: r => r.problems.join("; ") || "—" }], data.merges, { id: "merges" }));
  return out;
};

// How each kind of push is found (timeline.py): the loop's push stage, a training's --push-every-steps, a call
// whose tokens span two versions.
const PUSH_STYLES = {
  "iteration end": { colour: "#dc2626", dash: "", width: 2, kind: "push-iteration" },
  "training step": { colour: "#dc2626", dash: "4 3", width: 1, kind: "push-step" },
  "in flight": { colour: "#ea580c", dash: "1 3", width: 2, kind: "push-inflight" },
};

pages.engines = async () => {
  const data = await api("/api/engines");
  const out = [h("h2", {}, "Engines")];
  if (!data.engines.length) out.push(h("p", { class: "muted" }, "no calls recorded yet"));
  for (const lane of data.engines) {
    const calls = lane.calls;
    const t0 = Math.min(...calls.map(c => c.start), ...data.pushes.map(p => p.time));
    const t1 = Math.max(...calls.map(c => c.end), ...data.pushes.map(p => p.time));
    const rows = []; // greedy lanes: a call goes on the first row free at its start
    const placed = calls.map(c => { let row = rows.findIndex(end => end <= c.start); if (row < 0) { row = rows.length; rows.push(0); } rows[row] = c.end; return [c, row]; });
    const width = 1100, rowH = 14, pad = 40, height = Math.max(60, rows.length * rowH + 40);
    const X = t => pad + (t - t0) / Math.max(1e-6, t1 - t0) * (width - 2 * pad);
    const svg = s("svg", { width, height, class: "timeline" });
    for (const [c, row] of placed) {
      const rect = s("rect", { x: X(c.start), y: 10 + row * rowH, width: Math.max(1.5, X(c.end) - X(c.start)), height: rowH - 3, fill: "#93c5fd", class: "call" });
      rect.append(s("title", {}, `${c.session_id} #${c.seq} · ${c.stage} · weights ${c.weight_version} · ${(c.end - c.start).toFixed(2)}s${c.first_token ? ` · first token +${(c.first_token - c.start).toFixed(2)}s (engine's queue + prefill)` : ""}`));
      svg.append(rect);
      if (c.first_token) svg.append(s("line", { x1: X(c.first_token), x2: X(c.first_token), y1: 10 + row * rowH, y2: 10 + row * rowH + rowH - 3, stroke: "#1e3a8a" }));
    }
    const labelled = new Set(); // a version's label once, at its first mark
    for (const p of data.pushes) {
      const style = PUSH_STYLES[p.source] || PUSH_STYLES["iteration end"];
      const line = s("line", { x1: X(p.time), x2: X(p.time), y1: 0, y2: height - 20, stroke: style.colour, "stroke-dasharray": style.dash, "stroke-width": style.width, class: `push ${style.kind}` });
      line.append(s("title", {}, `v${p.weight_version} · ${p.source} · ${p.stage} · ${p.detail}`));
      svg.append(line);
      if (!labelled.has(p.weight_version)) { labelled.add(p.weight_version); svg.append(s("text", { x: X(p.time) + 2, y: height - 6, "font-size": 10, fill: style.colour }, `v${p.weight_version}`)); }
    }
    out.push(h("h3", {}, `${lane.engine} · ${fmt.text(lane.kind)} · ${lane.total_calls} calls${lane.total_calls > calls.length ? ` (latest ${calls.length} drawn)` : ""}`),
      h("p", { class: "legend" }, `${fmt.time(t0)} → ${fmt.time(t1)} · a bar per call (start → end; a dark tick at the first token where the engine reported its queue and prefill times: calls answered whole, not streamed — ${calls.filter(c => c.first_token).length} of ${calls.length} here) · weight pushes: `,
        ...Object.entries(PUSH_STYLES).map(([name, st]) => h("span", { style: `color:${st.colour};margin-right:1em` }, `┆ ${name}`))), svg);
  }
  out.push(h("h3", {}, `Weight pushes (${data.pushes.length})`), table([{ key: "time", label: "at", cell: r => fmt.time(r.time) }, { key: "weight_version", label: "version" }, { key: "source", label: "found by" }, { key: "stage", label: "stage" }, { key: "detail", label: "detail" }], data.pushes, { id: "pushes", rowData: r => ({ source: r.source }) }));
  return out;
};

pages.evaluation = async () => {
  const data = await api("/api/evaluation");
  const out = [h("h2", {}, `Evaluation (${data.evaluations.length})`)];
  if (!data.evaluations.length) out.push(h("p", { class: "muted" }, "no held-out evaluation in this run (loop --eval-tasks)"));
  const ks = [...new Set(data.evaluations.flatMap(e => Object.keys(e.pass_at || {})))];
  out.push(table([{ key: "stage", label: "evaluation" }, { key: "weight_version", label: "weights" }, { key: "sessions", label: "sessions", num: true }, { key: "reward_mean", label: "reward", num: true, cell: r => fmt.num(r.reward_mean) }, ...ks.map(k => ({ key: k, label: k, num: true, cell: r => fmt.num((r.pass_at || {})[k]) })), { key: "seconds", label: "seconds", num: true, cell: r => fmt.num(r.seconds, 1) }], data.evaluations, { id: "evaluations" }));
  for (const e of data.evaluations) {
    const tks = [...new Set(e.tasks.flatMap(t => Object.keys(t.pass_at)))];
    out.push(h("h3", {}, `${e.stage} per task`), table([{ key: "task_id", label: "task" }, { key: "samples", label: "samples", num: true }, { key: "passed", label: "passed", num: true }, ...tks.map(k => ({ key: k, label: k, num: true, cell: t => fmt.num(t.pass_at[k]) }))], e.tasks, { onRow: t => go("sessions", new URLSearchParams({ stage: e.stage, task_id: t.task_id })) }));
  }
  return out;
};

pages.service = async () => {
  const data = await api("/api/service");
  const staged = data.tasks.some(t => t.stage); // loop --service: per iteration; a serve-rollouts folder: none
  return [h("h2", {}, `Rollout service tasks (${data.tasks.length})`), data.tasks.length ? table([...(staged ? [{ key: "stage", label: "stage" }] : []), { key: "task_id", label: "task" }, { key: "status", label: "state" }, { key: "sessions_asked", label: "asked", num: true }, { key: "sessions_finished", label: "finished", num: true }, { key: "reward_mean", label: "reward", num: true, cell: r => fmt.num(r.reward_mean) }, { key: "statuses", label: "sessions by status", cell: r => Object.entries(r.statuses || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "—" }], data.tasks, { id: "service-tasks", onRow: r => go("sessions", new URLSearchParams({ task_id: r.task_id })) }) : h("p", { class: "muted", id: "service-none" }, "not a service run: no rollout service's tasks (serve-rollouts --out, or loop --service)")];
};

// -- routing and live updates ---------------------------------------------------------------------------------
const LIVE_PARTS = { overview: ["iterations", "events"], sessions: ["sessions"], discarded: ["sessions", "iterations"], engines: ["sessions", "iterations"], evaluation: ["iterations", "sessions"], service: ["sessions"], session: ["sessions"] };

async function render() {
  const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
  const [page, ...rest] = (path || "overview").split("/");
  state.page = pages[page] ? page : "overview";
  state.params = new URLSearchParams(query || "");
  document.querySelectorAll("#nav a").forEach(a => a.classList.toggle("active", a.dataset.page === state.page || (state.page === "session" && a.dataset.page === "sessions")));
  const main = document.getElementById("main");
  try {
    const nodes = await pages[state.page](decodeURIComponent(rest.join("/")));
    const scroll = window.scrollY;
    main.replaceChildren(...nodes);
    window.scrollTo(0, scroll);
    // Each token box opens on its first sampled token, as the report's viewer does (a system prompt fills screens).
    main.querySelectorAll(".tokens").forEach(box => { const first = box.querySelector(".tk.m1"); if (first) box.scrollTop = Math.max(0, first.offsetTop - 60); });
    state.loads += 1;
    main.dataset.loads = String(state.loads);
  } catch (err) {
    main.replaceChildren(h("p", { class: "error" }, String(err)));
  }
}

function listen() {
  const live = document.getElementById("live");
  const events = new EventSource("/api/stream");
  events.addEventListener("hello", () => { live.textContent = "live"; live.className = "live on"; });
  events.addEventListener("change", e => {
    const parts = JSON.parse(e.data).parts;
    if (state.page === "session" && !parts.includes("sessions")) return;
    if ((LIVE_PARTS[state.page] || []).some(p => parts.includes(p))) render();
  });
  events.onerror = () => { live.textContent = "reconnecting"; live.className = "live off"; };
}

window.addEventListener("hashchange", render);
window.addEventListener("DOMContentLoaded", async () => {
  try { const o = await api("/api/overview"); if (!o.service && !o.stages.some(st => st.kind === "service")) { const svc = await api("/api/service"); if (!svc.tasks.length) document.querySelector('#nav a[data-page="service"]').classList.add("hidden"); } } catch (err) { /* shown by render */ }
  render();
  listen();
});
