"""The page :mod:`.html` fills in: inline CSS and JavaScript, no network fetches.

The data arrives as one JSON object in ``<script type="application/json">``; the script
builds every element with ``textContent`` (never ``innerHTML``), so attribute values
cannot inject markup.
"""

DATA_TOKEN = "__RAYLOAD_TRACE_DATA__"

TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rayload startup trace</title>
<style>
  :root { --label-w: 280px; --row-h: 20px; --ink: #1f2933; --muted: #616e7c; --rule: #e4e7eb;
          --warn: #b45309; --err: #c81e1e; --hi: #fff8e1; }
  * { box-sizing: border-box; }
  body { margin: 0; padding: 20px 24px 40px; font: 13px/1.4 system-ui, -apple-system, "Segoe UI",
         Roboto, sans-serif; color: var(--ink); background: #fff; }
  h1 { font-size: 18px; margin: 0 0 4px; font-weight: 600; }
  .summary { color: var(--muted); margin-bottom: 10px; }
  .summary b { color: var(--ink); font-weight: 600; }
  .summary .warn { color: var(--warn); }
  .summary .err { color: var(--err); }
  .legend { display: flex; flex-wrap: wrap; gap: 6px 14px; margin: 8px 0 14px; }
  .legend-item { display: inline-flex; align-items: center; gap: 5px; color: var(--muted); }
  .swatch { width: 12px; height: 12px; border-radius: 2px; display: inline-block; }
  .chart { border-top: 1px solid var(--rule); }
  .axis { display: flex; height: 24px; border-bottom: 1px solid var(--rule); }
  .axis-label { width: var(--label-w); flex: none; }
  .axis-track { position: relative; flex: 1; margin-right: 36px; }
  .tick { position: absolute; bottom: 3px; transform: translateX(-50%); color: var(--muted);
          font-size: 11px; white-space: nowrap; }
  .lane { display: flex; border-bottom: 1px solid var(--rule); }
  .lane.slowest { background: var(--hi); }
  .lane-label { width: var(--label-w); flex: none; padding: 5px 10px 5px 0; }
  .lane-name { font-weight: 600; }
  .lane-meta { color: var(--muted); font-size: 12px; }
  .marker { display: inline-block; font-size: 11px; font-weight: 600; padding: 0 5px;
            border-radius: 3px; margin: 2px 4px 0 0; }
  .slowest-marker { background: #f59e0b; color: #fff; }
  .fallback-marker { color: var(--warn); background: #fef3c7; }
  .error-marker { color: #fff; background: var(--err); }
  .lane-track { position: relative; flex: 1; margin: 4px 36px 4px 0; }
  .gridline { position: absolute; top: 0; bottom: 0; width: 0;
              border-left: 1px dotted var(--rule); }
  .bar { position: absolute; height: calc(var(--row-h) - 3px); border-radius: 2px; min-width: 1px;
         overflow: hidden; white-space: nowrap; text-overflow: ellipsis; font-size: 11px;
         line-height: calc(var(--row-h) - 3px); padding: 0 4px; color: #111; cursor: default; }
  .bar.light-text { color: #fff; }
  .bar.error { outline: 2px solid var(--err); outline-offset: -2px;
               background-image: repeating-linear-gradient(45deg, transparent 0 5px,
                 rgba(200,30,30,.35) 5px 8px); }
  .bar:hover { filter: brightness(1.08); box-shadow: 0 0 0 1px #111 inset; }
  #tooltip { position: fixed; pointer-events: none; display: none; max-width: 460px; z-index: 10;
             background: #111827; color: #f9fafb; border-radius: 4px; padding: 8px 10px;
             font-size: 12px; box-shadow: 0 4px 14px rgba(0,0,0,.25); }
  #tooltip .tt-title { font-weight: 600; margin-bottom: 4px; }
  #tooltip table { border-collapse: collapse; }
  #tooltip td { padding: 0 8px 0 0; vertical-align: top; word-break: break-all; }
  #tooltip td:first-child { color: #9ca3af; white-space: nowrap; word-break: normal; }
  footer { margin-top: 14px; color: var(--muted); font-size: 12px; }
</style>
</head>
<body>
<h1>rayload startup trace</h1>
<div class="summary" id="summary"></div>
<div class="legend" id="legend"></div>
<div class="chart" id="chart"></div>
<footer id="footer"></footer>
<div id="tooltip"></div>
<script type="application/json" id="trace-data">__RAYLOAD_TRACE_DATA__</script>
<script>
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("trace-data").textContent);
  const el = (tag, cls, text) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  };
  const fmt = (ms) => ms >= 1000 ? (ms / 1000).toFixed(ms >= 10000 ? 1 : 2) + " s"
                     : ms >= 10 ? ms.toFixed(0) + " ms" : ms.toFixed(2) + " ms";
  const span = Math.max(data.durationMs, 1e-6);
  const pct = (ms) => (100 * ms / span) + "%";

  const summary = document.getElementById("summary");
  const part = (label, value, cls) => {
    const s = el("span", cls);
    s.append(label + " ", el("b", null, value));
    return s;
  };
  const parts = [part("trace", data.traceId), part("tp_size", String(data.tpSize)),
                 part("total", fmt(data.durationMs))];
  if (data.slowest) {
    parts.push(part("slowest", "rank " + data.slowest.rank + " (" + fmt(data.slowest.ms) + ")"));
  }
  if (data.fallbacks) parts.push(part("fallbacks", String(data.fallbacks), "warn"));
  if (data.errors) parts.push(part("errors", String(data.errors), "err"));
  parts.forEach((p, i) => { if (i) summary.append(" \u00b7 "); summary.append(p); });

  const legend = document.getElementById("legend");
  for (const item of data.legend) {
    const entry = el("span", "legend-item");
    const sw = el("span", "swatch");
    sw.style.background = item.color;
    entry.append(sw, item.name);
    legend.append(entry);
  }

  const step = (() => {
    const raw = span / 8, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 5, 10]) if (raw <= m * mag) return m * mag;
    return 10 * mag;
  })();
  const inSeconds = span >= 2000;
  const decimals = Math.max(0, -Math.floor(Math.log10((inSeconds ? step / 1000 : step) + 1e-12)));
  const tickLabel = (t) => t === 0 ? "0" : inSeconds
    ? (t / 1000).toFixed(decimals) + " s" : t.toFixed(decimals) + " ms";
  const ticks = [];
  for (let t = 0; t <= span + 1e-9; t += step) ticks.push(t);

  const chart = document.getElementById("chart");
  const axis = el("div", "axis");
  const axisTrack = el("div", "axis-track");
  for (const t of ticks) {
    const tick = el("span", "tick", tickLabel(t));
    tick.style.left = pct(t);
    axisTrack.append(tick);
  }
  axis.append(el("div", "axis-label"), axisTrack);
  chart.append(axis);

  const tooltip = document.getElementById("tooltip");
  const showTip = (ev, s) => {
    tooltip.replaceChildren();
    tooltip.append(el("div", "tt-title", s.name + " \u2014 " + fmt(s.endMs - s.startMs)));
    const table = el("table");
    const row = (k, v) => {
      const tr = el("tr");
      tr.append(el("td", null, k), el("td", null, v));
      table.append(tr);
    };
    row("start", "+" + fmt(s.startMs));
    row("status", s.status);
    if (s.error) row("error", s.error);
    for (const [k, v] of Object.entries(s.attrs)) row(k, v);
    tooltip.append(table);
    tooltip.style.display = "block";
    const x = Math.min(ev.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
    const y = Math.min(ev.clientY + 14, window.innerHeight - tooltip.offsetHeight - 8);
    tooltip.style.left = Math.max(x, 4) + "px";
    tooltip.style.top = Math.max(y, 4) + "px";
  };

  for (const lane of data.lanes) {
    const row = el("div", "lane" + (lane.slowest ? " slowest" : ""));
    row.dataset.lane = lane.key;
    const label = el("div", "lane-label");
    label.append(el("div", "lane-name", lane.label));
    const meta = [];
    if (lane.method) meta.push(lane.method);
    if (lane.durationMs !== null) meta.push(fmt(lane.durationMs));
    if (meta.length) label.append(el("div", "lane-meta", meta.join(" \u00b7 ")));
    if (lane.slowest) label.append(el("span", "marker slowest-marker", "slowest rank"));
    if (lane.fallback) {
      label.append(el("span", "marker fallback-marker", "\u26a0 fallback: " + lane.fallback));
    }
    if (lane.error) label.append(el("span", "marker error-marker", "\u2716 error: " + lane.error));
    const track = el("div", "lane-track");
    track.style.height = "calc(var(--row-h) * " + lane.rows + ")";
    for (const t of ticks) {
      const g = el("div", "gridline");
      g.style.left = pct(t);
      track.append(g);
    }
    for (const s of lane.spans) {
      const bar = el("div", "bar" + (s.error ? " error" : "") + (s.lightText ? " light-text" : ""),
                     s.label);
      bar.dataset.span = s.name;
      bar.style.left = pct(s.startMs);
      bar.style.width = pct(s.endMs - s.startMs);
      bar.style.top = "calc(var(--row-h) * " + s.row + ")";
      bar.style.background = s.color;
      bar.addEventListener("mousemove", (ev) => showTip(ev, s));
      bar.addEventListener("mouseleave", () => { tooltip.style.display = "none"; });
      track.append(bar);
    }
    row.append(label, track);
    chart.append(row);
  }
  for (const bar of document.querySelectorAll(".bar")) {
    if (bar.offsetWidth < 34) bar.textContent = "";
  }
  document.getElementById("footer").textContent =
    "Times are on the driver's clock (rank clocks corrected by the measured offset). " +
    "Started " + new Date(data.startUnixNs / 1e6).toISOString() + ".";
})();
</script>
</body>
</html>
"""
