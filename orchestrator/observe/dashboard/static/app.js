// The dashboard's pages: every job (/) and one job (/job/ID). Each asks the server for new
// figures every POLL_MS and redraws; nothing else is kept. Text is set as text, never as HTML.
"use strict";

const POLL_MS = 2000;
const CSRF = document.querySelector('meta[name="csrf-token"]').content;

const MARKER_STYLE = {  // kind -> [colour, dash]: the report's colours
  preemption: ["#d62728", [6, 4]], host_lost: ["#8c1a1a", [6, 4]], worker_crash: ["#e377c2", [6, 4]],
  hung: ["#bcbd22", [6, 4]], failure: ["#ff7f0e", [6, 4]], restore: ["#2ca02c", [2, 3]],
  checkpoint: ["#7f7f7f", [1, 4]], move: ["#9467bd", [8, 3, 2, 3]], adoption: ["#17becf", [10, 3]],
};
const TIER_COLOUR = {"spot": "#ff9f1c", "on-demand": "#1f77b4", "reserved": "#2ca02c"};
const CATEGORY_COLOUR = {
  productive: "#2ca02c", waiting_for_capacity: "#bdbdbd", provisioning: "#9ecae1", runtime_init: "#3182bd",
  compile: "#9467bd", restore: "#17becf", checkpoint_save: "#8c564b", lost_work: "#d62728", idle: "#eeeeee",
};

// -- small helpers ------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k === "title") e.title = v;
    else if (k === "href") e.href = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmt(x, digits) { return x === null || x === undefined ? "-" : Number(x).toFixed(digits); }
function int(x) { return x === null || x === undefined ? "-" : Math.round(x).toLocaleString("en-US"); }
function usd(x) {
  if (x === null || x === undefined) return "-";
  return "$" + Number(x).toLocaleString("en-US", {minimumFractionDigits: 2, maximumFractionDigits: 2});
}
function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%"; }
function duration(s) {
  if (s === null || s === undefined) return "-";
  if (s < 60) return s.toFixed(1) + "s";
  const r = Math.round(s), m = Math.floor(r / 60), h = Math.floor(m / 60), pad = n => String(n).padStart(2, "0");
  return h ? `${h}h ${pad(m % 60)}m ${pad(r % 60)}s` : `${m}m ${pad(r % 60)}s`;
}
function clock(t) { return new Date(t * 1000).toLocaleTimeString("en-GB", {hour12: false}); }

function stateBadge(row) {
  const shown = row.cause ? `${row.state}_${row.cause.toUpperCase()}` : row.state;  // FAILED_BUDGET, as status says
  const text = shown + (row.queue_position ? ` #${row.queue_position}` : "");
  return el("span", {class: `state s-${row.state.toLowerCase()}`, title: row.reason, text});
}

function replaceBody(table, rows, empty) {
  const body = table.tBodies[0];
  body.replaceChildren(...rows);
  if (!rows.length && empty) body.append(el("tr", {}, el("td", {colspan: table.tHead.rows[0].cells.length,
                                                                class: "muted", text: empty})));
}

async function getJSON(url) {
  const r = await fetch(url, {credentials: "same-origin", cache: "no-store"});
  if (r.status === 401) throw new Error("logged out: open the link `orchestrator dashboard` prints");
  if (!r.ok) throw new Error(`${r.status} ${(await r.json().catch(() => ({}))).error || r.statusText}`);
  return r.json();
}

async function post(url, body) {
  const r = await fetch(url, {method: "POST", credentials: "same-origin", cache: "no-store",
                              headers: {"Content-Type": "application/json", "X-CSRF-Token": CSRF},
                              body: JSON.stringify(body || {})});
  const answer = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(answer.error || `${r.status}`);
  return answer.message || "done";
}

function poll(fn) {
  const updated = document.getElementById("updated");
  const tick = async () => {
    try {
      await fn();
      updated.textContent = "updated " + new Date().toLocaleTimeString("en-GB", {hour12: false});
      updated.classList.remove("stale");
    } catch (e) {
      updated.textContent = String(e.message || e);
      updated.classList.add("stale");
    }
    setTimeout(tick, POLL_MS);
  };
  tick();
}

function tile(label, value, title) {
  return el("div", {class: "tile", title}, el("div", {class: "value", text: value}), el("div", {class: "label", text: label}));
}

// -- all jobs --------------------------------------------------------------------------------

function jobsPage() {
  // A page of the jobs at a time (those not ended first, newest first): a thousand jobs in full would
  // take the server seconds to read and the browser seconds to draw, every 2 s.
  let page = 1;
  document.getElementById("prev").addEventListener("click", () => { page = Math.max(1, page - 1); });
  document.getElementById("next").addEventListener("click", () => { page += 1; });
  poll(async () => {
    const d = await getJSON(`/api/overview?page=${page}`);
    const t = d.totals;
    page = d.page;
    document.getElementById("totals").replaceChildren(
      tile("jobs not ended", String(t.active)), tile("chips in use", String(t.chips_in_use)),
      tile("chips requested", String(t.chips_requested), "asked for, not yet ready (never billed while queued)"),
      tile("spent, jobs on this page", usd(t.usd_page)));
    replaceBody(document.getElementById("jobs"), d.jobs.map(jobRow), "no jobs yet: orchestrator submit job.yaml");
    const states = Object.entries(t.by_state).map(([s, n]) => `${n} ${s}`).join(", ");
    document.getElementById("page-of").textContent =
      `page ${d.page} of ${d.pages} (${t.jobs} job${t.jobs === 1 ? "" : "s"}${states ? ": " + states : ""})`;
    document.getElementById("prev").disabled = d.page <= 1;
    document.getElementById("next").disabled = d.page >= d.pages;
    replaceBody(document.getElementById("slices"), d.slices.map(s => el("tr", {},
      el("td", {class: "mono", text: s.name}), el("td", {}, el("a", {href: `/job/${s.job_id}`, text: s.job_name})),
      el("td", {text: s.accelerator}), el("td", {class: "num", text: String(s.chips)}),
      el("td", {}, el("span", {class: `tier t-${s.tier}`, text: s.tier})), el("td", {text: s.zone}),
      el("td", {text: s.in_use ? `in use (${s.state})` : `requested (${s.state})`}),
      el("td", {class: "num", text: usd(s.usd_per_hour)}))), "no slices held or requested");
    moreRow(document.getElementById("slices"), t.slices - d.slices.length, "slices");
    replaceBody(document.getElementById("queue"), d.queue.map(q => el("tr", {},
      el("td", {class: "num", text: String(q.position)}), el("td", {}, el("a", {href: `/job/${q.id}`, text: q.id})),
      el("td", {text: `${q.accelerator} ${q.tier}` + (q.hosts ? ` (${q.hosts} host${q.hosts > 1 ? "s" : ""})` : "")}),
      el("td", {class: "num", text: duration(d.now - q.since)}), el("td", {class: "reason", text: q.reason}))),
      "nothing waits");
    moreRow(document.getElementById("queue"), t.queued - d.queue.length, "jobs waiting");
  });
}

function moreRow(table, more, what) {  // the lists are cut at the server's LIST_MAX: say how many more
  if (more > 0) table.tBodies[0].append(el("tr", {}, el("td", {colspan: "8", class: "muted", text: `and ${more} more ${what}`})));
}

function jobRow(j) {
  const progress = el("div", {class: "progress"}, el("div", {class: "fill"}));
  progress.firstChild.style.width = j.total_steps ? `${Math.min(100, 100 * j.step / j.total_steps)}%` : "0";
  const state = el("td", {}, stateBadge(j));
  if (j.moving) state.append(el("div", {class: "moving small", text: j.moving}));
  if (j.warning) state.append(el("div", {class: "moving small", text: j.warning}));
  return el("tr", {"data-job": j.id},
    el("td", {}, el("a", {href: `/job/${j.id}`, class: "mono", text: j.id})),
    state,
    el("td", {class: "num step", title: `${j.step} of ${j.total_steps ?? "?"} steps`},
       el("span", {class: "step-count", text: `${j.step}/${j.total_steps ?? "?"}`}), progress),
    el("td", {class: "num", text: fmt(j.loss, 4)}), el("td", {class: "num", text: int(j.tokens_per_s)}),
    el("td", {class: "num", text: pct(j.goodput)}), el("td", {class: "num", text: usd(j.usd)}),
    el("td", {class: "num", text: usd(j.usd_expected)}), el("td", {class: "num", text: duration(j.wall_s)}),
    el("td", {text: `${j.accelerator} `}, el("span", {class: `tier t-${j.tier}`, text: j.tier})));
}

// -- one job ----------------------------------------------------------------------------------

const charts = {};

function markerPlugin(getMarkers, axis) {
  // Draws each event as a labelled vertical line, in the marker kind's colour and dash.
  return {hooks: {draw: u => {
    const ctx = u.ctx, {top, height} = u.bbox;
    ctx.save();
    ctx.font = `${Math.round(10 * devicePixelRatio)}px system-ui, sans-serif`;
    const rows = [], rowH = 12 * devicePixelRatio, maxRows = Math.max(1, Math.floor((height - 6) / rowH / 2));
    for (const m of getMarkers()) {
      const v = axis === "step" ? m.step : m.minutes;
      if (v === null || v === undefined) continue;
      const x = Math.round(u.valToPos(v, "x", true));
      if (x < u.bbox.left - 1 || x > u.bbox.left + u.bbox.width + 1) continue;
      const [colour, dash] = MARKER_STYLE[m.kind] || ["#000", []];
      ctx.strokeStyle = colour; ctx.fillStyle = colour; ctx.setLineDash(dash.map(d => d * devicePixelRatio));
      ctx.lineWidth = devicePixelRatio;
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
      if (m.kind === "checkpoint") continue;  // saves are many: their lines say enough; the legend names them
      // Each label goes on the first row where it meets no other (rows fill the upper half of the plot).
      const w = ctx.measureText(m.label).width, right = x + 3 + w > u.bbox.left + u.bbox.width;
      const from = right ? x - 3 - w : x + 3, to = from + w;
      let row = rows.findIndex(end => end < from - 4);
      if (row < 0 && rows.length < maxRows) row = rows.length;
      if (row < 0) row = rows.indexOf(Math.min(...rows));
      rows[row] = to;
      ctx.textAlign = right ? "right" : "left";
      ctx.fillText(m.label, right ? x - 3 : x + 3, top + rowH * (row + 1));
    }
    ctx.restore();
  }}};
}

function chartWidth(id) { return Math.max(300, document.getElementById(id).clientWidth || 560); }

function drawChart(id, key, opts, data) {
  const c = charts[id];
  if (c && c.key === key) { c.plot.setData(data); return; }
  if (c) c.plot.destroy();
  const host = document.getElementById(id);
  host.replaceChildren();
  charts[id] = {key, plot: new uPlot({width: chartWidth(id), height: 220, ...opts}, data, host)};
}

function jobPage() {
  const jobId = document.body.dataset.job;
  let current = null, filter = "";
  const byKind = {};
  document.getElementById("event-filter").addEventListener("change", e => { filter = e.target.value; renderEvents(); });
  document.getElementById("cancel").addEventListener("click", async () => {
    if (!confirm(`Cancel ${jobId}? Its hosts checkpoint the current step and stop; the slice is released.`)) return;
    act(() => post(`/api/jobs/${jobId}/cancel`));
  });
  document.getElementById("profile").addEventListener("click", () => act(() => post(`/api/jobs/${jobId}/profile`, {steps: 3})));
  document.getElementById("actions").addEventListener("submit", e => {
    e.preventDefault();
    const accelerator = document.getElementById("resize-acc").value, tier = document.getElementById("resize-tier").value;
    act(() => post(`/api/jobs/${jobId}/resize`, {accelerator, tier}));
  });
  async function act(fn) {
    const out = document.getElementById("action-result");
    out.textContent = "…";
    try { out.textContent = await fn(); } catch (e) { out.textContent = "refused: " + e.message; }
  }

  function renderEvents() {
    if (!current) return;
    const rows = current.events.filter(e => !filter || (filter === "disruption" ? e.cause || e.kind === "disruption"
      : filter === "state" ? e.kind === "state" : e.category === filter || e.kind === filter));
    replaceBody(document.getElementById("events"), rows.slice(-400).reverse().map(e => el("tr", {class: `ev k-${e.cause || e.category.replace(/ /g, "_")}`},
      el("td", {class: "mono", text: clock(e.at)}), el("td", {class: "num", text: "+" + duration(e.at - current.created_at)}),
      el("td", {}, el("span", {class: `ek ek-${e.cause || e.category.replace(/ /g, "_")}`,
                               text: e.kind === "state" ? `${e.from_state || ""} → ${e.to_state}` : e.category})),
      el("td", {class: "reason", text: e.reason}))), "no events of this kind");
  }

  let resizeFilled = false;
  poll(async () => {
    const [j, logs] = await Promise.all([getJSON(`/api/jobs/${jobId}`), getJSON(`/api/jobs/${jobId}/logs`)]);
    current = j;
    document.getElementById("name").textContent = `${j.name}`;
    const line = document.getElementById("state-line");
    line.replaceChildren(stateBadge(j), el("span", {class: "mono", text: ` ${j.id}  `}),
                         el("span", {text: `${j.accelerator} `}), el("span", {class: `tier t-${j.tier}`, text: j.tier}),
                         el("span", {class: "muted", text: `  ${j.reason}`}));
    document.getElementById("moving").textContent = j.moving || "";
    document.getElementById("error").textContent = j.error || "";
    document.getElementById("tiles").replaceChildren(
      tile("step", `${j.step}/${j.total_steps ?? "?"}`), tile("loss", fmt(j.loss, 4)),
      tile("tokens/s", int(j.tokens_per_s)), tile("goodput", pct(j.goodput), "productive step time over wall time"),
      tile("$ so far", usd(j.usd)), tile("$ expected", usd(j.usd_expected), "so far, plus the steps left at the recent pace on the slices held now"),
      tile("wall time", duration(j.wall_s)),
      tile("disruptions", `${j.counts.preemptions} / ${j.counts.failures}`, "preemptions and host losses / failures"),
      tile("restarts", String(j.counts.restarts)), tile("recomputed", `${j.counts.lost_steps} steps`));
    // actions
    document.getElementById("cancel").disabled = j.done;
    document.getElementById("profile").disabled = j.state !== "RUNNING";
    document.getElementById("resize").disabled = !j.resize_to.allowed;
    if (!resizeFilled) {
      resizeFilled = true;
      document.getElementById("resize-acc").replaceChildren(...j.resize_to.accelerators.map(a => el("option", {value: a, text: a})));
      document.getElementById("resize-tier").replaceChildren(...j.resize_to.tiers.map(t => el("option", {value: t, text: t})));
      document.getElementById("resize-acc").value = j.accelerator;
      document.getElementById("resize-tier").value = j.tier;
    }
    // curves
    const c = j.curves, t0 = j.created_at;
    const markers = j.markers.map(m => ({...m, minutes: (m.at - t0) / 60}));
    const seen = new Set(markers.map(m => m.kind));
    const stepOpts = (label, colour, yLabel) => ({
      scales: {x: {time: false}}, axes: [{label: "step"}, {label: yLabel, size: 60}],
      series: [{label: "step"}, {label, stroke: colour, width: 1.5, points: {show: c.step.length < 200}}],
      plugins: [markerPlugin(() => markers, "step")], legend: {show: true}});
    drawChart("chart-loss", "loss", stepOpts("loss", "#1f77b4", "loss"), [c.step, c.loss]);
    drawChart("chart-tps", "tps", stepOpts("tokens/s", "#ff7f0e", "tokens / s"), [c.step, c.tokens_per_s]);
    const chipX = j.chips.at.map(t => (t - t0) / 60);
    const groups = j.chips.series;
    const stepped = uPlot.paths.stepped({align: 1});
    drawChart("chart-chips", "chips:" + groups.map(g => g.accelerator + g.tier).join(","), {
      scales: {x: {time: false}}, axes: [{label: "minutes"}, {label: "chips", size: 50}],
      series: [{label: "min"}, ...groups.map((g, i) => ({label: `${g.accelerator} ${g.tier}`,
        stroke: TIER_COLOUR[g.tier] || "#555", fill: (TIER_COLOUR[g.tier] || "#555") + "33", width: 1.5, paths: stepped,
        dash: i % 2 ? [5, 3] : undefined, points: {show: false}}))],
      plugins: [markerPlugin(() => markers, "minutes")]}, [chipX, ...groups.map(g => g.chips)]);
    drawChart("chart-cost", "cost", {
      scales: {x: {time: false}}, axes: [{label: "minutes"}, {label: "US$", size: 60}],
      series: [{label: "min"}, {label: "cost $", stroke: "#333", fill: "#cccccc88", width: 1.5, points: {show: false}}],
      plugins: [markerPlugin(() => markers, "minutes")]}, [j.cost.at.map(t => (t - t0) / 60), j.cost.usd]);
    document.getElementById("legend").replaceChildren(...Object.keys(MARKER_STYLE).filter(k => seen.has(k)).map(k => {
      const sw = el("span", {class: "swatch"}); sw.style.borderColor = MARKER_STYLE[k][0];
      sw.style.borderStyle = MARKER_STYLE[k][1].length ? "dashed" : "solid";
      return el("span", {class: "key"}, sw, markerTitle(k, j.markers));
    }));
    // goodput
    const bar = document.getElementById("goodput-bar");
    bar.replaceChildren(...j.goodput_breakdown.filter(g => g.share > 0).map(g => {
      const part = el("div", {title: `${g.category.replace(/_/g, " ")} ${pct(g.share)} (${duration(g.seconds)})`,
                              text: g.share > 0.07 ? pct(g.share) : ""});
      part.style.width = `${100 * g.share}%`; part.style.background = CATEGORY_COLOUR[g.category];
      return part;
    }));
    replaceBody(document.getElementById("goodput"), j.goodput_breakdown.map(g => {
      const sw = el("span", {class: "swatch block"}); sw.style.background = CATEGORY_COLOUR[g.category];
      return el("tr", {}, el("td", {}, sw, g.category.replace(/_/g, " ")), el("td", {class: "num", text: duration(g.seconds)}),
                el("td", {class: "num", text: pct(g.share)}));
    }).concat([el("tr", {class: "total"}, el("td", {text: j.done ? "wall time" : "wall time so far"}),
                  el("td", {class: "num", text: duration(j.wall_s)}), el("td", {class: "num", text: "100.0%"}))]));
    replaceBody(document.getElementById("slices"), j.slices.map(s => el("tr", {},
      el("td", {class: "mono", text: s.name}), el("td", {text: `${s.accelerator} (${s.chips} chips)`}),
      el("td", {}, el("span", {class: `tier t-${s.tier}`, text: s.tier})), el("td", {text: s.zone}),
      el("td", {text: s.state}), el("td", {class: "num", text: usd(s.usd)}))), "no slices yet");
    renderEvents();
    const pre = document.getElementById("logs");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.textContent = logs.lines.join("\n") || "(no output yet)";
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  });
  window.addEventListener("resize", () => {
    for (const [id, c] of Object.entries(charts)) c.plot.setSize({width: chartWidth(id), height: 220});
  });
}

function markerTitle(kind, markers) {
  const n = markers.filter(m => m.kind === kind).length;
  const title = (markers.find(m => m.kind === kind) || {}).title || kind;
  return `${title} (${n})`;
}

if (document.body.dataset.page === "jobs") jobsPage(); else jobPage();
