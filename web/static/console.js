// Tollgate console: copy buttons, confirmations and small SVG charts that refresh.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const HISTORY = 150; // gauge samples kept in the page (5 minutes at one per 2 s)
const REFRESH_MS = 2000;

function svgNode(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (parent) parent.appendChild(node);
  return node;
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function short(value) {
  if (Math.abs(value) >= 1e6) return (value / 1e6).toFixed(1) + "M";
  if (Math.abs(value) >= 1e3) return (value / 1e3).toFixed(1) + "k";
  return Number.isInteger(value) ? String(value) : value.toFixed(2);
}

// series: [{name, values: [number|null]}]; labels: x-axis labels (first and last shown).
function lineChart(figure, series, labels, options = {}) {
  // Drawn at the figure's own width, so text is never stretched.
  const width = Math.max(240, Math.round(figure.clientWidth || 600));
  const height = 180, left = 44, right = 8, top = 8, bottom = 22;
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  const ymax = options.ymax || niceMax(Math.max(0, ...all));
  const n = Math.max(2, ...series.map((s) => s.values.length));
  const x = (i) => left + (i * (width - left - right)) / (n - 1);
  const y = (v) => top + (1 - v / ymax) * (height - top - bottom);
  const svg = svgNode("svg", { viewBox: `0 0 ${width} ${height}`, focusable: "false", "aria-hidden": "true" });
  for (const fraction of [0, 0.5, 1]) {
    const value = ymax * fraction;
    svgNode("line", { x1: left, x2: width - right, y1: y(value), y2: y(value), class: "grid-line" }, svg);
    const label = svgNode("text", { x: left - 4, y: y(value) + 4, "text-anchor": "end" }, svg);
    label.textContent = options.percent ? Math.round(value * 100) + "%" : short(value);
  }
  svgNode("line", { x1: left, x2: left, y1: top, y2: height - bottom, class: "axis" }, svg);
  if (labels.length) {
    const first = svgNode("text", { x: left, y: height - 6 }, svg);
    first.textContent = labels[0];
    const last = svgNode("text", { x: width - right, y: height - 6, "text-anchor": "end" }, svg);
    last.textContent = labels[labels.length - 1];
  }
  series.forEach((s, index) => {
    const points = s.values
      .map((v, i) => (v === null || v === undefined ? null : `${x(i).toFixed(1)},${y(v).toFixed(1)}`))
      .filter(Boolean);
    if (points.length) svgNode("polyline", { points: points.join(" "), class: "s" + index }, svg);
  });
  figure.replaceChildren(svg);
  if (series.length > 1 || options.legend) {
    const legend = document.createElement("ul");
    legend.className = "legend";
    series.forEach((s, index) => {
      const item = document.createElement("li");
      item.className = "k" + index;
      item.textContent = s.name;
      legend.appendChild(item);
    });
    figure.appendChild(legend);
  }
  const latest = series.map((s) => `${s.name}: ${short(s.values[s.values.length - 1] || 0)}`).join(", ");
  figure.dataset.latest = latest;
  const first = series.length ? series[0].values : [];
  figure.dataset.total = String(first.reduce((sum, v) => sum + (v || 0), 0));
  figure.setAttribute("aria-label", (figure.dataset.title || figure.getAttribute("aria-label").split(" (")[0]) + ` (latest ${latest})`);
}

function clock(epochSeconds) {
  return new Date(epochSeconds * 1000).toISOString().slice(11, 19);
}

function ms(value) {
  return value === null || value === undefined ? "-" : value.toFixed(1) + " ms";
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
}

function fillTable(table, rows, empty) {
  const body = table.tBodies[0];
  body.replaceChildren();
  if (!rows.length) {
    const tr = body.insertRow();
    cell(tr, empty);
    tr.cells[0].colSpan = table.tHead.rows[0].cells.length;
    return;
  }
  for (const values of rows) {
    const tr = body.insertRow();
    values.forEach((v) => cell(tr, v));
  }
}

// A list of "reason: count" items, or one "none" when `counts` is empty.
function listCounts(list, counts) {
  const entries = Object.entries(counts);
  list.replaceChildren();
  for (const [reason, count] of entries.length ? entries : [["none", ""]]) {
    const li = document.createElement("li");
    li.textContent = count === "" ? reason : `${reason}: ${count}`;
    list.appendChild(li);
  }
}

const gauges = { t: [], waiting: [], running: [], kv: [], hits: [] };
const latencyHistory = {}; // workload class -> TTFT p95 (ms) at each refresh

function drawOverview(data) {
  const n = data.requests_per_s.length;
  const labels = [clock(data.start), clock(data.start + n * data.bucket_s)];
  lineChart(document.getElementById("chart-requests"), [{ name: "requests/s", values: data.requests_per_s }], labels);
  lineChart(document.getElementById("chart-tokens"), [{ name: "tokens/s", values: data.tokens_per_s }], labels);
  const sum = (key) => data.replicas.reduce((total, r) => total + r[key], 0);
  const worst = (key) => Math.max(0, ...data.replicas.map((r) => r[key] || 0));
  gauges.t.push(data.now);
  gauges.waiting.push(sum("waiting"));
  gauges.running.push(sum("running"));
  gauges.kv.push(worst("kv_used_fraction"));
  gauges.hits.push(worst("prefix_cache_hit_rate"));
  for (const c of data.latency) {
    latencyHistory[c.class] = latencyHistory[c.class] || new Array(gauges.t.length - 1).fill(null);
  }
  for (const [name, values] of Object.entries(latencyHistory)) {
    const now = data.latency.find((c) => c.class === name);
    values.push(now ? now.ttft_p95_ms : null);
  }
  if (gauges.t.length > HISTORY) {
    for (const k of Object.keys(gauges)) gauges[k].shift();
    for (const values of Object.values(latencyHistory)) values.shift();
  }
  const gaugeLabels = [clock(gauges.t[0]), clock(gauges.t[gauges.t.length - 1])];
  lineChart(document.getElementById("chart-queue"), [
    { name: "waiting", values: gauges.waiting },
    { name: "running", values: gauges.running },
  ], gaugeLabels);
  lineChart(document.getElementById("chart-ttft"),
    Object.entries(latencyHistory).map(([name, values]) => ({ name: name + " p95", values })),
    gaugeLabels, { legend: true });
  lineChart(document.getElementById("chart-kv"), [
    { name: "KV cache used", values: gauges.kv },
    { name: "prefix-cache hit rate", values: gauges.hits },
  ], gaugeLabels, { ymax: 1, percent: true });
  fillTable(document.getElementById("latency"), data.latency.map((c) => [
    c.class, String(c.requests), ms(c.ttft_p50_ms), ms(c.ttft_p95_ms), ms(c.itl_p50_ms), ms(c.itl_p95_ms),
  ]), "No requests in the last 10 minutes.");
  fillTable(document.getElementById("replicas"), data.replicas.map((r) => [
    r.name, r.healthy ? "healthy" : "down", String(r.running), String(r.waiting),
    Math.round(r.kv_used_fraction * 100) + "%",
    r.prefix_cache_hit_rate === null ? "-" : Math.round(r.prefix_cache_hit_rate * 100) + "%",
  ]), "No engine connected.");
  const outcomes = document.getElementById("outcomes");
  outcomes.replaceChildren();
  const pairs = [["Requests", data.total_requests], ...Object.entries(data.outcomes)];
  for (const [name, count] of pairs) {
    const dt = document.createElement("dt"); dt.textContent = name;
    const dd = document.createElement("dd"); dd.textContent = String(count);
    outcomes.append(dt, dd);
  }
  listCounts(document.getElementById("rejections"), data.rejections);
  listCounts(document.getElementById("reasons"), data.not_completed_by_reason);
  document.getElementById("updated").textContent = "Updated " + clock(data.now) + " UTC.";
}

async function refreshOverview(root) {
  try {
    const response = await fetch(root.dataset.source, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (response.redirected || !(response.headers.get("content-type") || "").includes("json")) {
      window.location.assign("/admin/login?next=/admin"); // the session ended
      return;
    }
    drawOverview(await response.json());
    root.dataset.refreshes = String(Number(root.dataset.refreshes || 0) + 1);
  } catch (error) {
    document.getElementById("updated").textContent = "Update failed; retrying.";
  }
  window.setTimeout(() => refreshOverview(root), REFRESH_MS);
}

function drawTenantSeries(source, figure) {
  const days = JSON.parse(source.textContent);
  lineChart(figure, [{ name: "tokens", values: days.map((d) => d.tokens) }],
    days.length ? [days[0].day, days[days.length - 1].day] : [], { legend: true });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("button[data-copy]").forEach((button) => {
    button.addEventListener("click", async () => {
      const input = document.getElementById(button.dataset.copy);
      const status = button.parentElement.querySelector(".copied");
      input.select();
      try {
        await navigator.clipboard.writeText(input.value);
      } catch (error) {
        document.execCommand("copy"); // older browsers, or no clipboard permission
      }
      if (status) status.textContent = "Copied.";
    });
  });
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  });
  const overview = document.getElementById("overview");
  if (overview) refreshOverview(overview);
  const series = document.getElementById("tenant-series");
  if (series) drawTenantSeries(series, document.getElementById("chart-tenant"));
});
