/* k3 atlas, part 2: the expert grid, the weight viewer (Leaflet over PNG tiles), distinct values,
 * expert similarity, distributions, tokens and routing. Uses the helpers of app.js (window.K3). */
"use strict";

(function () {
  const K = window.K3;
  const esc = K.escapeHtml;
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const SIGNED = new Set(["min", "max", "mean", "sign_balance"]);

  // ---- colour scales ----------------------------------------------------------------------------------
  function hexRgb(h) {
    const n = parseInt(h.replace("#", ""), 16);
    return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
  }
  function mix(a, b, t) {
    return `rgb(${a.map((x, i) => Math.round(x + (b[i] - x) * t)).join(",")})`;
  }
  /** Diverging: the weights' own scale (negative red, zero = background, positive amber). */
  function diverging(v, vmax) {
    const bg = hexRgb(css("--bg"));
    const t = Math.min(1, Math.abs(v) / (vmax || 1)) ** 0.5;
    return mix(bg, hexRgb(v >= 0 ? css("--pos") : css("--neg")), t);
  }
  /** Sequential, for statistics without a sign: dark blue-grey to amber. */
  function sequential(t) {
    const stops = [[24, 28, 40], [70, 60, 110], [200, 90, 80], [255, 183, 3], [255, 240, 190]];
    const x = Math.max(0, Math.min(1, t)) * (stops.length - 1);
    const i = Math.min(stops.length - 2, Math.floor(x));
    return mix(stops[i], stops[i + 1], x - i);
  }

  // ---- small SVG charts ---------------------------------------------------------------------------------
  /** Bars: items [{label, value, color?, title?}], heights on a linear or log scale. */
  function barChart(el, items, { height = 160, log = false, labelEvery = 1 } = {}) {
    if (!items.length) {
      el.innerHTML = "";
      return;
    }
    const width = Math.max(320, el.clientWidth || 640);
    const pad = { l: 64, r: 8, t: 8, b: 28 };
    const h = height - pad.t - pad.b;
    const bw = (width - pad.l - pad.r) / items.length;
    const f = (v) => (log ? Math.log10(1 + v) : v);
    const max = Math.max(...items.map((d) => f(d.value)), 1e-12);
    const bars = items
      .map((d, i) => {
        const bh = (h * f(d.value)) / max;
        const x = pad.l + i * bw;
        const label = i % labelEvery === 0 ? `<text x="${x + bw / 2}" y="${height - 10}" text-anchor="middle">${esc(d.label)}</text>` : "";
        return `<rect x="${x + bw * 0.1}" y="${pad.t + h - bh}" width="${Math.max(1, bw * 0.8)}" height="${bh}" fill="${d.color || css("--pos")}"><title>${esc(d.title || `${d.label}: ${d.value}`)}</title></rect>${label}`;
      })
      .join("");
    const topLabel = log ? K.fmtBig(Math.round(10 ** max - 1)) : K.fmtNum(max, 3);
    el.innerHTML = `<svg viewBox="0 0 ${width} ${height}" height="${height}">
      <line x1="${pad.l}" y1="${pad.t + h}" x2="${width - pad.r}" y2="${pad.t + h}" stroke="${css("--line")}"/>
      <text x="${pad.l - 6}" y="${pad.t + 10}" text-anchor="end">${esc(topLabel)}</text>
      <text x="${pad.l - 6}" y="${pad.t + h}" text-anchor="end">0</text>${bars}</svg>`;
  }

  // ---- the expert grid --------------------------------------------------------------------------------
  const grid = { doc: null };
  async function loadGrid() {
    const stat = document.getElementById("grid-stat").value;
    grid.doc = await K.get(`api/grid/${stat}.json`);
    const sel = document.getElementById("grid-matrix");
    const matrices = Object.keys(grid.doc.matrices);
    const keep = matrices.includes(sel.value) ? sel.value : matrices[0];
    sel.innerHTML = matrices.map((m) => `<option ${m === keep ? "selected" : ""}>${esc(m)}</option>`).join("");
    drawGrid();
    drawAcross();
  }
  function drawGrid() {
    const doc = grid.doc;
    const canvas = document.getElementById("grid-canvas");
    const spreadCanvas = document.getElementById("grid-spread");
    const m = document.getElementById("grid-matrix").value;
    if (!doc || !doc.matrices[m]) return;
    const values = doc.matrices[m];
    const E = doc.experts;
    const L = doc.layers.length;
    const cell = Math.max(1, Math.min(32, Math.floor(1000 / E)));
    const rowH = Math.max(3, Math.min(24, Math.floor(520 / L)));
    canvas.width = E * cell;
    canvas.height = L * rowH;
    const flat = values.flat().filter((v) => v != null);
    const lo = Math.min(...flat);
    const hi = Math.max(...flat);
    const signed = SIGNED.has(doc.stat) && lo < 0;
    const vmax = Math.max(Math.abs(lo), Math.abs(hi));
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = css("--panel");
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const color = (v) => (signed ? diverging(v, vmax) : sequential(hi > lo ? (v - lo) / (hi - lo) : 0.5));
    values.forEach((row, li) =>
      row.forEach((v, e) => {
        if (v == null) return;
        ctx.fillStyle = color(v);
        ctx.fillRect(e * cell, li * rowH, cell, rowH);
      }),
    );
    // spread across experts, one bar per layer
    const spreads = doc.spread[m].map((s) => (s && s.relative_range != null ? s.relative_range : 0));
    const smax = Math.max(...spreads, 1e-12);
    spreadCanvas.width = 120;
    spreadCanvas.height = canvas.height;
    const sctx = spreadCanvas.getContext("2d");
    sctx.fillStyle = css("--panel");
    sctx.fillRect(0, 0, 120, canvas.height);
    sctx.fillStyle = css("--experts");
    spreads.forEach((s, li) => sctx.fillRect(0, li * rowH + 1, (118 * s) / smax, Math.max(1, rowH - 2)));
    spreadCanvas.title = `${K.t("grid.spread")}: max ${K.fmtPct(smax)}`;
    const ramp = signed
      ? `linear-gradient(90deg, ${css("--neg")}, ${css("--bg")} 50%, ${css("--pos")})`
      : `linear-gradient(90deg, ${[0, 0.25, 0.5, 0.75, 1].map(sequential).join(",")})`;
    document.getElementById("grid-scale").innerHTML = `<span>${esc(K.fmtNum(signed ? -vmax : lo))}</span><span class="ramp" style="background:${ramp}"></span><span>${esc(K.fmtNum(signed ? vmax : hi))}</span>
      <span>· ${esc(K.t("grid.spread"))}: ${esc(K.fmtPct(smax))} max</span>`;
    grid.cell = cell;
    grid.rowH = rowH;
  }
  function gridHit(e) {
    const canvas = document.getElementById("grid-canvas");
    const r = canvas.getBoundingClientRect();
    const e_ = Math.floor((e.clientX - r.left) / grid.cell);
    const li = Math.floor((e.clientY - r.top) / grid.rowH);
    const m = document.getElementById("grid-matrix").value;
    if (!grid.doc || li < 0 || li >= grid.doc.layers.length || e_ < 0 || e_ >= grid.doc.experts) return null;
    return { layer: grid.doc.layers[li], expert: e_, value: grid.doc.matrices[m][li][e_], id: grid.doc.ids[m][li][e_] };
  }

  // ---- the weight viewer ---------------------------------------------------------------------------------
  const viewer = { map: null, layer: null, values: new Map() };
  function viewerLevel() {
    const t = K.tensor;
    if (!t || !viewer.map) return null;
    return viewer.map.getZoom();
  }
  function drawViewerFoot() {
    const t = K.tensor;
    if (!t) return;
    const geo = t.tiles;
    const z = viewerLevel();
    const f = 2 ** Math.max(0, geo.max_level - Math.min(z, geo.max_level));
    const mode = document.getElementById("viewer-mode").value;
    const vmax = geo.vmax == null ? null : mode === "mean" ? geo.vmax / f : geo.vmax;
    document.getElementById("viewer-scale").textContent = vmax == null ? "" : K.t("viewer.scale", { vmax: K.fmtNum(vmax, 3) });
    let level = f > 1 ? K.t("viewer.block", { f }) : K.t("viewer.single");
    if (geo.row_sampled_up_to_level != null && z <= geo.row_sampled_up_to_level) level += ` (${K.t("viewer.sampled")})`;
    document.getElementById("viewer-level").textContent = level;
  }
  function showTensorInViewer() {
    const t = K.tensor;
    const geo = t.tiles;
    document.getElementById("viewer-name").textContent = `${t.name}  [${t.shape.join("×")}] ${t.dtype}`;
    const mode = document.getElementById("viewer-mode").value;
    if (!viewer.map) {
      viewer.map = L.map("weight-map", { crs: L.CRS.Simple, minZoom: -2, zoomSnap: 1, attributionControl: false });
      viewer.map.on("zoomend", drawViewerFoot);
      viewer.map.on("mousemove", onViewerHover);
    }
    if (viewer.layer) viewer.map.removeLayer(viewer.layer);
    const top = geo.max_level;
    const exported = K.summary.static ? Math.min(top, K.summary.tile_levels) : top;
    // at zoom `top` one weight = one pixel; map units are weights scaled by 2^-top
    const bounds = L.latLngBounds(viewer.map.unproject([0, geo.rows], top), viewer.map.unproject([geo.cols, 0], top));
    viewer.layer = L.tileLayer(`api/tiles/${t.id}/${mode}/{z}/{x}/{y}.png`, {
      tileSize: geo.tile,
      minZoom: 0,
      minNativeZoom: 0,
      maxNativeZoom: exported,
      maxZoom: top + 6,
      bounds,
      noWrap: true,
      keepBuffer: 1,
    });
    viewer.layer.addTo(viewer.map);
    viewer.map.setMaxZoom(top + 6);
    viewer.map.setMaxBounds(bounds.pad(0.5));
    viewer.map.fitBounds(bounds, { animate: false }); // a new matrix: jump, no zoom animation from the old one
    viewer.bounds = bounds;
    drawViewerFoot();
  }
  async function onViewerHover(e) {
    const t = K.tensor;
    if (!t) return;
    const geo = t.tiles;
    const p = viewer.map.project(e.latlng, geo.max_level);
    const row = Math.floor(p.y);
    const col = Math.floor(p.x);
    const out = document.getElementById("viewer-hover");
    if (row < 0 || col < 0 || row >= geo.rows || col >= geo.cols) {
      out.textContent = "";
      return;
    }
    let text = K.t("viewer.hover", { row, col });
    if (K.summary.static) {
      out.textContent = `${text} ${K.t("viewer.static_values")}`;
      return;
    }
    const r0 = row - (row % 16);
    const c0 = col - (col % 16);
    const key = `${t.id}:${r0}:${c0}`;
    if (!viewer.values.has(key)) viewer.values.set(key, K.get(`api/values/${t.id}.json?r=${r0}&c=${c0}&h=16&w=16`));
    out.textContent = text;
    try {
      const block = await viewer.values.get(key);
      const v = block.values[row - r0][col - c0];
      text += ` · ${K.t("viewer.value", { value: K.fmtNum(v, 6) })}`;
      if (K.tensor === t) out.textContent = text;
    } catch (err) {
      /* a window outside the matrix: nothing to show */
    }
  }

  // ---- distinct values, distributions ------------------------------------------------------------------
  function drawValues() {
    const t = K.tensor;
    const s = t && t.stats;
    const intro = document.getElementById("values-intro");
    if (!s) {
      intro.textContent = K.t("viewer.none");
      return;
    }
    const distinct = s.distinct_exact ? K.fmtInt(s.distinct_values) : K.t("values.lower_bound", { distinct: K.fmtInt(s.distinct_values) });
    intro.innerHTML = K.tHtml("values.intro", { name: t.name, params: K.fmtInt(t.params), distinct });
    const chart = document.getElementById("values-chart");
    if (s.values) {
      const vmax = Math.max(...s.values.map(([v]) => Math.abs(v || 0)));
      const items = s.values.map(([v, c]) => ({
        label: v == null ? "NaN" : K.fmtNum(v, 3),
        value: c,
        color: v == null ? css("--norms") : v === 0 ? css("--line") : diverging(v, vmax),
        title: `${K.t("values.value")} ${v == null ? "NaN" : K.fmtNum(v, 8)} · ${K.t("values.count")} ${K.fmtInt(c)}`,
      }));
      barChart(chart, items, { height: 200, log: true, labelEvery: Math.ceil(items.length / 14) });
    } else {
      chart.innerHTML = `<p class="intro">${esc(K.t("values.too_many"))}</p>`;
    }
    const mx = t.dtype === "MXFP4";
    document.querySelectorAll(".mxfp4-only").forEach((el) => el.classList.toggle("hidden", !mx));
    if (mx) {
      const E2M1 = ["+0", ".5", "1", "1.5", "2", "3", "4", "6", "-0", "-.5", "-1", "-1.5", "-2", "-3", "-4", "-6"];
      barChart(
        document.getElementById("codes-chart"),
        s.code_histogram.map((c, i) => ({ label: E2M1[i], value: c, color: i < 8 ? css("--pos") : css("--neg") })),
        { height: 140 },
      );
      const used = s.scale_histogram.map((c, i) => [i, c]).filter(([, c]) => c > 0);
      barChart(
        document.getElementById("scales-chart"),
        used.map(([i, c]) => ({ label: `2^${i - 127}`, value: c, color: css("--latent") })),
        { height: 140, labelEvery: Math.ceil(used.length / 8) },
      );
    }
  }
  function drawMagnitude() {
    const t = K.tensor;
    const s = t && t.stats;
    const title = document.getElementById("dist-mag-title");
    if (!s) return;
    title.textContent = K.t("dist.magnitude", { name: t.name });
    const h = s.magnitude_histogram;
    const items = h.counts.map((c, i) => {
      const e = h.first_log2 + i / h.per_octave;
      return { label: Number.isInteger(e) ? `2^${e}` : "", value: c, color: css("--pos"), title: `|w| ∈ [2^${e}, 2^${e + 1 / h.per_octave}): ${K.fmtInt(c)}` };
    });
    const zeros = Math.round(s.zero_fraction * s.numel);
    if (zeros) items.unshift({ label: "0", value: zeros, color: css("--line"), title: K.t("dist.zeros", { n: K.fmtInt(zeros) }) });
    barChart(document.getElementById("dist-magnitude"), items, { height: 180 });
  }
  function drawAcross() {
    const doc = grid.doc;
    if (!doc) return;
    const m = document.getElementById("grid-matrix").value;
    const vals = (doc.matrices[m] || []).flat().filter((v) => v != null);
    document.getElementById("dist-across-title").textContent = K.t("dist.across", { stat: doc.stat });
    if (!vals.length) return;
    const lo = Math.min(...vals);
    const hi = Math.max(...vals);
    const bins = 40;
    const counts = new Array(bins).fill(0);
    vals.forEach((v) => counts[hi > lo ? Math.min(bins - 1, Math.floor(((v - lo) / (hi - lo)) * bins)) : 0]++);
    barChart(
      document.getElementById("dist-across"),
      counts.map((c, i) => ({ label: i % 8 === 0 ? K.fmtNum(lo + ((hi - lo) * i) / bins, 3) : "", value: c, color: css("--experts"), title: `${K.fmtNum(lo + ((hi - lo) * i) / bins)}: ${c}` })),
      { height: 150 },
    );
  }

  // ---- expert similarity ---------------------------------------------------------------------------------
  async function drawSimilarity() {
    const layer = document.getElementById("sim-layer").value;
    if (layer === "") return;
    const doc = await K.get(`api/similarity/${layer}.json`);
    const msel = document.getElementById("sim-matrix");
    const mats = Object.keys(doc.matrices);
    const keep = mats.includes(msel.value) ? msel.value : mats[0];
    msel.innerHTML = mats.map((m) => `<option ${m === keep ? "selected" : ""}>${esc(m)}</option>`).join("");
    const chart = document.getElementById("sim-matrix-chart");
    const neighbours = document.getElementById("sim-neighbours");
    if (!keep) {
      chart.innerHTML = `<p class="intro">${esc(K.t("similarity.none"))}</p>`;
      neighbours.innerHTML = "";
      return;
    }
    const { subset, pairs } = doc.matrices[keep];
    const cos = new Map(pairs.map(([a, b, c]) => [`${a},${b}`, c]));
    document.getElementById("sim-subset-title").textContent = K.t("similarity.subset", { n: subset.length });
    const offdiag = pairs.filter(([a, b]) => subset.includes(a) && subset.includes(b)).map(([, , c]) => Math.abs(c || 0));
    const vmax = Math.max(1e-6, ...offdiag);
    const n = subset.length;
    const size = Math.min(420, chart.clientWidth || 420);
    const cell = (size - 40) / n;
    let rects = "";
    subset.forEach((a, i) =>
      subset.forEach((b, j) => {
        const c = i === j ? 1 : cos.get(a < b ? `${a},${b}` : `${b},${a}`);
        const fill = i === j ? css("--panel-2") : diverging(c || 0, vmax);
        rects += `<rect x="${40 + j * cell}" y="${i * cell}" width="${cell - 1}" height="${cell - 1}" fill="${fill}"><title>${a} · ${b}: ${c == null ? "–" : K.fmtNum(c, 4)}</title></rect>`;
      }),
    );
    const labels = subset.map((a, i) => `<text x="36" y="${i * cell + cell / 2 + 4}" text-anchor="end">${a}</text>`).join("");
    chart.innerHTML = `<svg viewBox="0 0 ${size} ${size - 40 + 16}" height="${size - 24}">${rects}${labels}
      <text x="40" y="${size - 28}">±${esc(K.fmtNum(vmax, 3))}</text></svg>`;
    const nb = pairs.filter(([a, b]) => b === a + 1);
    barChart(
      neighbours,
      nb.map(([a, b, c]) => ({ label: nb.length <= 24 || a % Math.ceil(nb.length / 12) === 0 ? String(a) : "", value: Math.abs(c || 0), color: (c || 0) >= 0 ? css("--pos") : css("--neg"), title: `${a}·${b}: ${K.fmtNum(c, 4)}` })),
      { height: 200 },
    );
  }

  // ---- tokens and routing ----------------------------------------------------------------------------------
  const routing = { result: null };
  function drawRoutingIntro() {
    const c = K.summary.census;
    document.getElementById("routing-intro").innerHTML = c ? K.tHtml("routing.intro", { topk: K.fmtInt(c.experts_per_token), experts: K.fmtInt(c.experts_per_layer) }) : "";
    document.getElementById("route-text").placeholder = K.t("routing.placeholder");
    const r = K.summary.routing;
    const note = document.getElementById("route-note");
    if (K.summary.static) note.textContent = K.t("routing.unavailable", { reason: K.t("routing.reasons.static") });
    else if (r && !r.available) note.textContent = K.t("routing.unavailable", { reason: reasonText(r) });
    else note.textContent = "";
    document.getElementById("route-run").disabled = Boolean(K.summary.static || (r && !r.available));
  }
  /** A routing refusal in the page's language when its code is known, else the server's words. */
  function reasonText(r) {
    const key = `routing.reasons.${r.code}`;
    const text = K.t(key);
    return text === key ? r.reason : text;
  }
  async function runRouting() {
    const text = document.getElementById("route-text").value || K.t("routing.placeholder");
    const res = await fetch("api/route.json", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ text }) });
    const doc = await res.json();
    if (!doc.available) {
      document.getElementById("route-note").textContent = K.t("routing.unavailable", { reason: reasonText(doc) });
      return;
    }
    routing.result = doc;
    const sel = document.getElementById("route-layer");
    const layers = Object.keys(doc.layers);
    const keep = layers.includes(sel.value) ? sel.value : layers[0];
    sel.innerHTML = layers.map((l) => `<option ${l === keep ? "selected" : ""}>${l}</option>`).join("");
    drawRouting();
  }
  function drawRouting() {
    const doc = routing.result;
    if (!doc) return;
    const layer = doc.layers[document.getElementById("route-layer").value];
    const hue = (e) => `hsl(${(e * 137.508) % 360}, 70%, 68%)`;
    const rows = doc.tokens.map((tok, i) => {
      const chips = layer.experts[i]
        .map((e, j) => `<span class="expert-chip" style="background:${hue(e)}" title="${e}: ${layer.weights[i][j]}">${e}</span>`)
        .join("");
      return `<tr><td><span class="tok">${esc(tok.piece)}</span></td><td class="mono">${tok.id}</td><td>${chips}</td></tr>`;
    });
    const E = doc.num_experts;
    const cell = Math.max(3, Math.min(16, Math.floor(900 / E)));
    const heat = document.createElement("canvas");
    heat.width = E * cell;
    heat.height = doc.tokens.length * 14;
    heat.className = "route-heat";
    heat.title = K.t("routing.heat");
    const ctx = heat.getContext("2d");
    ctx.fillStyle = css("--panel");
    ctx.fillRect(0, 0, heat.width, heat.height);
    const wmax = Math.max(...layer.weights.flat(), 1e-9);
    layer.experts.forEach((row, i) =>
      row.forEach((e, j) => {
        ctx.fillStyle = diverging(layer.weights[i][j], wmax);
        ctx.fillRect(e * cell, i * 14 + 1, cell, 12);
      }),
    );
    const tokens = doc.tokens.map((tok) => `<span class="tok">${esc(tok.piece)}</span>`).join("");
    document.getElementById("route-out").innerHTML = `<div class="route-tokens">${tokens}</div>
      <h3>${esc(K.t("routing.heat"))}</h3><div class="route-heat-wrap"></div><table class="route"><thead><tr><th>${esc(K.t("routing.token"))}</th><th>id</th><th>${esc(K.t("routing.experts"))}</th></tr></thead><tbody>${rows.join("")}</tbody></table>`;
    document.querySelector("#route-out .route-heat-wrap").appendChild(heat);
  }

  K.viewerMap = () => viewer.map;

  // ---- opening a tensor --------------------------------------------------------------------------------
  K.openTensor = async function (id, scroll) {
    K.tensor = await K.get(`api/tensor/${id}.json`);
    showTensorInViewer();
    drawValues();
    drawMagnitude();
    if (scroll) document.getElementById("viewer").scrollIntoView();
  };

  /** The tensor the viewer opens with: an expert matrix if there is one (the seed's subject), else the
   * largest matrix outside the layers or in the first layer. */
  async function firstTensor() {
    if (grid.doc) {
      const m = Object.keys(grid.doc.ids)[0];
      const row = m && grid.doc.ids[m][0];
      const id = row && row.find((x) => x != null);
      if (id != null) return id;
    }
    const doc = await K.get("api/layers.json");
    const candidates = (await K.get("api/tensors/other.json")).tensors.slice();
    if (doc.layers.length) candidates.push(...(await K.get(`api/layer/${doc.layers[0].index}.json`)).tensors);
    const matrices = candidates.filter((t) => t.shape.length === 2);
    const pool = matrices.length ? matrices : candidates;
    pool.sort((a, b) => b.params - a.params);
    return pool.length ? pool[0].id : null;
  }

  K.panelsStart = async function () {
    const s = K.summary;
    if (s.kind !== "checkpoint" || !s.tensors) return;
    document.getElementById("viewer-mode").addEventListener("change", () => K.tensor && showTensorInViewer());
    if (s.has_experts) {
      const statSel = document.getElementById("grid-stat");
      statSel.innerHTML = s.stat_keys.map((k) => `<option ${k === "rms" ? "selected" : ""}>${k}</option>`).join("");
      statSel.addEventListener("change", loadGrid);
      document.getElementById("grid-matrix").addEventListener("change", () => (drawGrid(), drawAcross()));
      const canvas = document.getElementById("grid-canvas");
      const tip = document.getElementById("tooltip");
      canvas.addEventListener("mousemove", (e) => {
        const hit = gridHit(e);
        const text = hit ? K.t("grid.hover", { layer: hit.layer, expert: hit.expert, value: K.fmtNum(hit.value, 5) }) : "";
        document.getElementById("grid-readout").textContent = text;
        tip.style.display = hit ? "block" : "none";
        tip.textContent = text;
        tip.style.left = `${e.clientX + 14}px`;
        tip.style.top = `${e.clientY + 14}px`;
      });
      canvas.addEventListener("mouseleave", () => (tip.style.display = "none"));
      canvas.addEventListener("click", (e) => {
        const hit = gridHit(e);
        if (hit && hit.id != null) K.openTensor(hit.id, true);
      });
      await loadGrid();
      const layers = grid.doc.layers;
      const simSel = document.getElementById("sim-layer");
      simSel.innerHTML = layers.map((l) => `<option>${l}</option>`).join("");
      simSel.addEventListener("change", drawSimilarity);
      document.getElementById("sim-matrix").addEventListener("change", drawSimilarity);
      await drawSimilarity();
      document.getElementById("route-run").addEventListener("click", runRouting);
      document.getElementById("route-layer").addEventListener("change", drawRouting);
      drawRoutingIntro();
    }
    const id = await firstTensor();
    if (id != null) await K.openTensor(id, false);
    K.onLanguage(() => {
      if (K.tensor) {
        drawViewerFoot();
        drawValues();
        drawMagnitude();
      }
      if (grid.doc) {
        drawGrid();
        drawAcross();
        drawSimilarity();
        drawRoutingIntro();
        drawRouting();
      }
    });
  };
})();
