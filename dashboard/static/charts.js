// Small SVG charts: a line chart over numeric x, and bars over time. No library: a few scales and paths.
"use strict";

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 640, H = 220, M = { l: 44, r: 12, t: 10, b: 28 };

  function svg(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function scale(d0, d1, r0, r1) {
    const span = d1 - d0 || 1;
    return (v) => r0 + ((v - d0) / span) * (r1 - r0);
  }

  // about n round values between lo and hi, no closer than minStep (1 for versions, 1 s for times)
  function ticks(lo, hi, n, minStep = 0) {
    if (hi === lo) return [lo];
    const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    const found = [1, 2, 5, 10].map((m) => m * step).find((s) => (hi - lo) / s <= n) || step * 10;
    const nice = minStep ? Math.max(minStep, Math.ceil(found / minStep) * minStep) : found;
    const out = [];
    for (let v = Math.ceil(lo / nice) * nice; v <= hi + 1e-9; v += nice) out.push(+v.toFixed(10));
    return out;
  }

  function frame(el, xs, ys, xFmt, yFmt, xMinStep = 0) {
    el.innerHTML = "";
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img" }, el);
    const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    const [y0, y1] = [Math.min(0, ...ys), Math.max(...ys, 1e-9)];
    const x = scale(x0, x1, M.l, W - M.r), y = scale(y0, y1, H - M.b, M.t);
    for (const v of ticks(y0, y1, 4)) {
      svg("line", { x1: M.l, x2: W - M.r, y1: y(v), y2: y(v), class: "grid-line" }, root);
      svg("text", { x: M.l - 6, y: y(v) + 4, "text-anchor": "end" }, root).textContent = yFmt(v);
    }
    for (const v of ticks(x0, x1, 8, xMinStep)) {
      svg("text", { x: x(v), y: H - 8, "text-anchor": "middle" }, root).textContent = xFmt(v);
    }
    return { root, x, y };
  }

  // series: [{name, color, points: [[x, y], ...], dashed}]
  function line(el, series, opts = {}) {
    const all = series.flatMap((s) => s.points).filter((p) => p[1] !== null && p[1] !== undefined);
    if (!all.length) { el.innerHTML = '<div class="empty">nothing in this range</div>'; return; }
    const { root, x, y } = frame(el, all.map((p) => p[0]), all.map((p) => p[1]),
      opts.xFmt || String, opts.yFmt || ((v) => v.toFixed(2)), opts.xMinStep || 0);
    for (const s of series) {
      const pts = s.points.filter((p) => p[1] !== null && p[1] !== undefined);
      if (!pts.length) continue;
      const d = pts.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");
      svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-dasharray": s.dashed ? "5 4" : "" }, root);
      for (const p of pts) {
        const dot = svg("circle", { cx: x(p[0]), cy: y(p[1]), r: 3, fill: s.color }, root);
        svg("title", {}, dot).textContent = `${s.name} · ${opts.xName || "x"} ${p[0]}: ${(+p[1]).toFixed(3)}`;
      }
    }
    const legend = document.createElement("div");
    legend.className = "chart-legend";
    legend.innerHTML = series.map((s) => `<span style="--c:${s.color}">${s.name}</span>`).join("");
    el.appendChild(legend);
  }

  // items: [{t (ms), v, label, color}]: a bar per item at its time, its height the value
  function bars(el, items, opts = {}) {
    if (!items.length) { el.innerHTML = '<div class="empty">nothing in this range</div>'; return; }
    const ts = items.map((i) => i.t);
    const pad = Math.max(1000, (Math.max(...ts) - Math.min(...ts)) * 0.03);
    const { root, x, y } = frame(el, [Math.min(...ts) - pad, Math.max(...ts) + pad], items.map((i) => i.v),
      (t) => new Date(t).toLocaleTimeString([], { hour12: false }),
      opts.yFmt || ((v) => v.toFixed(0)), 1000);
    for (const item of items) {
      const top = y(item.v), base = y(0);
      const bar = svg("rect", { x: x(item.t) - 3, y: top, width: 6, height: Math.max(1, base - top), fill: item.color || "#5fb3ff", rx: 1 }, root);
      svg("title", {}, bar).textContent = item.label;
    }
  }

  return { line, bars };
})();
