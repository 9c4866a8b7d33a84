// The live dashboard: /metrics every POLL_MS, the last WINDOW_S seconds as small line charts.
// Everything is derived from the scrapes kept here; the server keeps no state for the page.

import { parseMetrics, quantile, rate, ratio, total } from "./metrics.js";

const POLL_MS = 2000;
const WINDOW_S = 300; // what a chart shows
const RATE_S = 30; // rates, hit rates and percentiles are over this much of the past

const percentiles = (name) =>
  [0.5, 0.9, 0.99].map((q) => ({
    id: `p${Math.round(q * 100)}`,
    label: `p${Math.round(q * 100)}`,
    value: (past, now) => quantile(past, now, name, q),
  }));
const percent = (value) => (value === null ? null : value * 100);

const CHARTS = [
  {
    id: "requests",
    title: "Requests",
    unit: "",
    series: [
      { id: "running", label: "running", value: (_, now) => total(now.samples, "mmserve:num_requests_running") },
      { id: "waiting", label: "waiting", value: (_, now) => total(now.samples, "mmserve:num_requests_waiting") },
    ],
  },
  {
    id: "tokens",
    title: "Tokens per second",
    unit: " tok/s",
    series: [
      { id: "generation", label: "generated", value: (p, n) => rate(p, n, "mmserve:generation_tokens_total") },
      { id: "prompt", label: "prompt", value: (p, n) => rate(p, n, "mmserve:prompt_tokens_total") },
    ],
  },
  { id: "ttft", title: "Time to first token", unit: "s", series: percentiles("mmserve:time_to_first_token_seconds") },
  { id: "itl", title: "Inter-token latency", unit: "s", series: percentiles("mmserve:inter_token_latency_seconds") },
  {
    id: "kv",
    title: "KV cache use",
    unit: " %",
    max: 100,
    series: [{ id: "usage", label: "in use", value: (_, n) => 100 * total(n.samples, "mmserve:kv_cache_usage_perc") }],
  },
  {
    id: "prefix",
    title: "Prefix-cache hit rate",
    unit: " %",
    max: 100,
    series: [
      {
        id: "hits",
        label: "prompt tokens",
        value: (p, n) =>
          percent(ratio(p, n, "mmserve:prefix_cache_hits_total", ["mmserve:prefix_cache_queries_total"])),
      },
    ],
  },
  {
    id: "encoder",
    title: "Encoder-cache hit rate",
    unit: " %",
    max: 100,
    series: [
      {
        id: "hits",
        label: "images",
        value: (p, n) =>
          percent(
            ratio(p, n, "mmserve:encoder_cache_hits_total", [
              "mmserve:encoder_cache_hits_total",
              "mmserve:encoder_runs_total",
            ]),
          ),
      },
    ],
  },
  {
    id: "preprocess",
    title: "Preprocess pool queue",
    unit: "",
    series: [
      { id: "pending", label: "in flight", value: (_, n) => total(n.samples, "mmserve:preprocess_pending") },
    ],
  },
  {
    id: "mm-cache",
    title: "Preprocess-cache hit rate",
    unit: " %",
    max: 100,
    series: [
      {
        id: "hits",
        label: "images",
        value: (p, n) => percent(ratio(p, n, "mmserve:mm_cache_hits_total", ["mmserve:mm_cache_queries_total"])),
      },
    ],
  },
];

const scrapes = []; // {t: seconds, samples}, oldest first
const points = new Map(CHARTS.map((chart) => [chart.id, []])); // chart id → [{t, values}]

function format(value, unit) {
  if (value === null || Number.isNaN(value)) return "–";
  if (unit === "s") return value < 1 ? `${(value * 1000).toFixed(value < 0.01 ? 1 : 0)} ms` : `${value.toFixed(2)} s`;
  if (Number.isInteger(value) || value >= 100) return `${value.toFixed(0)}${unit}`;
  return `${value.toFixed(1)}${unit}`;
}

function svgElement(tag, attributes) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  return node;
}

function buildCharts(container) {
  for (const chart of CHARTS) {
    const card = document.createElement("section");
    card.className = "chart";
    card.dataset.chart = chart.id;
    card.setAttribute("aria-label", chart.title);
    const title = document.createElement("h2");
    title.textContent = chart.title;
    const legend = document.createElement("dl");
    legend.className = "legend";
    chart.series.forEach((series, index) => {
      const term = document.createElement("dt");
      term.className = `s${index}`;
      term.textContent = series.label;
      const value = document.createElement("dd");
      value.dataset.series = series.id;
      value.textContent = "–";
      legend.append(term, value);
    });
    const svg = svgElement("svg", { viewBox: "0 0 300 80", preserveAspectRatio: "none", "aria-hidden": "true" });
    chart.series.forEach((_, index) => svg.append(svgElement("polyline", { class: `s${index}`, points: "" })));
    card.append(title, legend, svg);
    container.append(card);
  }
}

function draw(now) {
  // The x axis spans the history there is, up to WINDOW_S (a fresh page is not a flat line).
  const span = Math.min(WINDOW_S, Math.max(20, now - scrapes[0].t));
  for (const chart of CHARTS) {
    const card = document.querySelector(`[data-chart=${chart.id}]`);
    const chartPoints = points.get(chart.id);
    const latest = chartPoints.at(-1)?.values ?? [];
    const values = chartPoints.flatMap((point) => point.values.filter((v) => v !== null));
    const top = chart.max ?? Math.max(1e-9, ...values) * 1.15;
    chart.series.forEach((series, index) => {
      card.querySelector(`[data-series=${series.id}]`).textContent = format(latest[index] ?? null, chart.unit);
      const line = chartPoints
        .filter((point) => point.values[index] !== null)
        .map((point) => {
          const x = 300 * (1 - (now - point.t) / span);
          const y = 78 - 76 * Math.min(1, point.values[index] / top);
          return `${x.toFixed(1)},${y.toFixed(1)}`;
        });
      card.querySelectorAll("polyline")[index].setAttribute("points", line.join(" "));
    });
  }
}

async function poll() {
  const status = document.getElementById("dashboard-status");
  try {
    const response = await fetch("metrics", { cache: "no-store" });
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    const now = { t: performance.now() / 1000, samples: parseMetrics(await response.text()) };
    scrapes.push(now);
    while (scrapes.length > 1 && now.t - scrapes[0].t > WINDOW_S) scrapes.shift();
    const past = scrapes.find((scrape) => now.t - scrape.t <= RATE_S) ?? now;
    const reference = past === now && scrapes.length > 1 ? scrapes.at(-2) : past;
    for (const chart of CHARTS) {
      const chartPoints = points.get(chart.id);
      chartPoints.push({ t: now.t, values: chart.series.map((series) => series.value(reference, now)) });
      while (chartPoints.length && now.t - chartPoints[0].t > WINDOW_S) chartPoints.shift();
    }
    draw(now.t);
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    status.textContent = `could not read /metrics: ${error.message}`;
  }
  setTimeout(poll, POLL_MS);
}

buildCharts(document.getElementById("charts"));
poll();
