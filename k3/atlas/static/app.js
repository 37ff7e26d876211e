/* k3 atlas, part 1: data loading, languages and number formatting, the hero, the guide, the layer map.
 * Every figure comes from the JSON API (api/*.json, the same files in a static export); the texts in
 * i18n/*.json hold placeholders only. Part 2 (panels.js) draws the expert grid, the weight viewer, the
 * distinct values, the similarity, the distributions and the routing panel. */
"use strict";

const K3 = (window.K3 = {
  lang: "es",
  texts: {},
  summary: null,
  layers: null,
  tensor: null, // the tensor document open in the viewer
  listeners: [], // redraw callbacks run after a language switch
});

// ---- data ---------------------------------------------------------------------------------------------
const cache = new Map();
K3.get = async function (path) {
  if (!cache.has(path)) {
    cache.set(
      path,
      fetch(path).then((r) => {
        if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
        return r.json();
      }),
    );
  }
  return cache.get(path);
};

// ---- languages ----------------------------------------------------------------------------------------
K3.t = function (key, vars) {
  let v = key.split(".").reduce((o, k) => (o == null ? o : o[k]), K3.texts[K3.lang]);
  if (v == null) return key;
  if (vars) v = v.replace(/\{(\w+)\}/g, (m, name) => (name in vars ? vars[name] : m));
  return v;
};

/** Text with {placeholders} replaced by highlighted live figures (HTML); `plain` vars are inserted as text. */
K3.tHtml = function (key, vars, plain = {}) {
  const raw = K3.t(key);
  return escapeHtml(raw).replace(/\{(\w+)\}/g, (m, name) => {
    if (name in plain) return escapeHtml(String(plain[name]));
    return name in vars ? `<b class="fig">${escapeHtml(String(vars[name]))}</b>` : m;
  });
};

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
K3.escapeHtml = escapeHtml;

function locale() {
  return K3.lang === "es" ? "es-ES" : "en-US";
}
K3.fmtInt = (n) => (n == null ? "–" : new Intl.NumberFormat(locale()).format(n));
K3.fmtNum = function (x, digits = 4) {
  if (x == null) return "–";
  if (x !== 0 && (Math.abs(x) < 1e-4 || Math.abs(x) >= 1e7)) return x.toExponential(digits - 1);
  return new Intl.NumberFormat(locale(), { maximumSignificantDigits: digits }).format(x);
};
K3.fmtPct = (x, digits = 1) =>
  x == null ? "–" : new Intl.NumberFormat(locale(), { style: "percent", maximumFractionDigits: digits }).format(x);
K3.fmtBig = function (n) {
  if (n == null) return "–";
  const u = K3.texts[K3.lang].units;
  const f = (x) => new Intl.NumberFormat(locale(), { maximumFractionDigits: 2 }).format(x);
  if (n >= 1e12) return `${f(n / 1e12)} ${u.trillion}`;
  if (n >= 1e9) return `${f(n / 1e9)} ${u.billion}`;
  if (n >= 1e6) return `${f(n / 1e6)} ${u.million}`;
  return K3.fmtInt(n);
};
K3.fmtBytes = function (n) {
  const units = K3.texts[K3.lang].units.bytes;
  let i = 0;
  while (n >= 1000 && i < units.length - 1) {
    n /= 1000;
    i++;
  }
  return `${new Intl.NumberFormat(locale(), { maximumFractionDigits: i ? 2 : 0 }).format(n)} ${units[i]}`;
};

async function setLanguage(lang) {
  if (!K3.texts[lang]) K3.texts[lang] = await K3.get(`i18n/${lang}.json`);
  K3.lang = lang;
  document.documentElement.lang = lang;
  document.querySelectorAll("#lang button").forEach((b) => b.classList.toggle("active", b.dataset.lang === lang));
  document.querySelectorAll("[data-t]").forEach((el) => (el.textContent = K3.t(el.dataset.t)));
  try {
    localStorage.setItem("k3-atlas-lang", lang);
  } catch (e) {
    /* storage may be unavailable (file://, privacy mode): the choice then lasts this visit */
  }
  for (const redraw of K3.listeners) redraw();
}
K3.onLanguage = (fn) => K3.listeners.push(fn);

// ---- the hero and the guide ---------------------------------------------------------------------------
function figures() {
  const s = K3.summary;
  const c = s.census;
  const m = s.measured || {};
  const total = c ? c.total_params : s.params;
  const v = {
    source: s.source,
    total_params: K3.fmtBig(total),
    disk: K3.fmtBytes(c ? c.disk_bytes : s.bytes),
    tensors: K3.fmtInt(s.tensors),
  };
  if (c) {
    Object.assign(v, {
      vocab: K3.fmtInt(s.config.vocab_size),
      active_params: K3.fmtBig(c.active_params),
      active_pct: K3.fmtPct(c.active_fraction),
      layers: K3.fmtInt(c.layers),
      kda: K3.fmtInt(c.kda_layers),
      mla: K3.fmtInt(c.mla_layers),
      moe_layers: K3.fmtInt(c.moe_layers),
      dense_layers: K3.fmtInt(c.dense_layers),
      experts: K3.fmtInt(c.experts_per_layer),
      topk: K3.fmtInt(c.experts_per_token),
      shared: K3.fmtInt(c.shared_experts_per_layer),
      params_per_expert: K3.fmtBig(c.params_per_expert),
      matrix_params: K3.fmtInt(c.params_per_expert_matrix),
      routed_experts: K3.fmtInt(c.routed_experts),
      expert_share: K3.fmtPct(c.expert_params / c.total_params),
    });
  }
  if (m.expert_distinct_median != null) {
    Object.assign(v, {
      distinct_median: K3.fmtInt(m.expert_distinct_median),
      distinct_min: K3.fmtInt(m.expert_distinct_min),
      distinct_max: K3.fmtInt(m.expert_distinct_max),
    });
  }
  if (m.neighbour_cosine_min != null) {
    v.cos_min = K3.fmtNum(m.neighbour_cosine_min, 3);
    v.cos_max = K3.fmtNum(m.neighbour_cosine_max, 3);
  }
  return v;
}
K3.figures = figures;

function drawHero() {
  const s = K3.summary;
  const v = figures();
  document.getElementById("title").textContent = K3.t("title", { source: s.source });
  const note = document.getElementById("status-note");
  if (s.kind === "config") note.textContent = K3.t("config_only");
  else if (!s.scan_complete) note.textContent = K3.t("scan_partial", { done: K3.fmtInt(s.scanned), total: K3.fmtInt(s.tensors) });
  else note.textContent = "";
  const items = [[v.total_params, "hero.params"]];
  if (s.census) {
    items.push([v.active_params, "hero.active"], [v.layers, "hero.layers"]);
    if (s.census.experts_per_layer) items.push([v.experts, "hero.experts"]);
  }
  items.push([v.disk, "hero.disk"]);
  if (s.kind === "checkpoint") items.push([v.tensors, "hero.tensors"]);
  document.getElementById("hero-figures").innerHTML = items
    .map(([num, lbl]) => `<div class="figure"><div class="num">${escapeHtml(num)}</div><div class="lbl">${escapeHtml(K3.t(lbl))}</div></div>`)
    .join("");
}

function drawGuide() {
  const s = K3.summary;
  const v = figures();
  const cards = [];
  const card = (title, live, body, extra = "") =>
    cards.push(`<div class="card"><h4>${escapeHtml(K3.t(title))}</h4><div class="live">${escapeHtml(live)}</div>${body}${extra}</div>`);
  if (s.census) {
    card("guide.tokens_title", v.vocab, `<p>${K3.tHtml("guide.tokens", v)}</p>`);
  }
  card("guide.weights_title", v.disk, `<p>${K3.tHtml("guide.weights", v)}</p>`);
  const mx = s.config && s.config.experts_mxfp4 ? "guide.mxfp4_yes" : "guide.mxfp4_no";
  card("guide.params_title", v.total_params, `<p>${K3.tHtml("guide.params", v, { mxfp4_sentence: K3.t(mx) })}</p>`);
  if (s.census) {
    card("guide.layers_title", v.layers, `<p>${K3.tHtml("guide.layers", v)}</p>`);
    card("guide.attention_title", `${v.kda} KDA · ${v.mla} MLA`, `<p>${K3.tHtml("guide.attention", v)}</p>`);
    if (s.census.experts_per_layer) {
      let measured = "";
      if (v.distinct_median) measured += `<p class="measured">${K3.tHtml("guide.experts_measured", v)}</p>`;
      if (v.cos_min) measured += `<p class="measured">${K3.tHtml("guide.cosine_measured", v)}</p>`;
      card("guide.experts_title", v.routed_experts, `<p>${K3.tHtml("guide.experts", v)}</p>`, measured);
      card("guide.router_title", `${v.topk} / ${v.experts}`, `<p>${K3.tHtml("guide.router", v)}</p>`);
    }
  }
  document.getElementById("guide-cards").innerHTML = cards.join("");
}

// ---- the layer map --------------------------------------------------------------------------------------
const PART_ORDER = ["attention", "router", "latent", "routed_experts", "shared_experts", "dense_mlp", "norms", "attn_res", "other"];

function layerKind(l) {
  const mixer = l.mixer ? K3.t(`layers.${l.mixer}`) : "";
  const ffn = l.ffn ? K3.t(`layers.${l.ffn}`) : "";
  return { mixer, ffn };
}

function drawLayerMap() {
  const doc = K3.layers;
  const rows = doc.layers;
  const maxParams = Math.max(1, ...rows.map((l) => l.params));
  const rhythm = document.getElementById("rhythm");
  rhythm.previousElementSibling.classList.toggle("hidden", !rows.some((l) => l.mixer));
  rhythm.innerHTML = rows
    .filter((l) => l.mixer)
    .map((l) => {
      const start = l.attn_res_block != null && l.attn_res_block > 0 && doc.attn_res_blocks[l.attn_res_block][0] === l.index;
      return `<span class="${l.mixer}${start ? " block-start" : ""}" data-layer="${l.index}" title="${escapeHtml(K3.t("layers.layer", { index: l.index }))} · ${l.mixer.toUpperCase()}"></span>`;
    })
    .join("");
  const used = new Set(rows.flatMap((l) => Object.keys(l.parts)));
  const legend = PART_ORDER.filter((p) => used.has(p)).map((p) => {
    if (p === "attention")
      return `<span><i class="p-attention kda"></i>${K3.t("layers.kda")}</span><span><i class="p-attention mla"></i>${K3.t("layers.mla")}</span>`;
    return `<span><i class="p-${p}"></i>${escapeHtml(K3.t(`layers.parts.${p}`))}</span>`;
  });
  if (doc.attn_res_blocks.length) legend.push(`<span><i style="border-left:2px solid #3b4256"></i>${escapeHtml(K3.t("layers.legend_attn_res"))}</span>`);
  if (doc.from === "tensors") legend.push(`<span>${escapeHtml(K3.t("layers.from_tensors"))}</span>`);
  document.getElementById("layer-legend").innerHTML = legend.join("");

  const html = rows.map((l) => {
    const { mixer, ffn } = layerKind(l);
    const block = l.attn_res_block;
    const blockStart = block != null && doc.attn_res_blocks[block][0] === l.index;
    const parts = PART_ORDER.filter((p) => l.parts[p])
      .map((p) => {
        const w = (100 * l.parts[p]) / l.params;
        const title = `${K3.t(`layers.parts.${p}`)}: ${K3.fmtInt(l.parts[p])}`;
        return `<span class="p-${p} ${p === "attention" ? l.mixer : ""}" style="width:${w}%" title="${escapeHtml(title)}"></span>`;
      })
      .join("");
    const bar = parts || `<span class="p-other" style="width:100%"></span>`;
    const title = K3.t("layers.open", { index: l.index, mixer: mixer || "?", ffn: ffn || "?", params: K3.fmtInt(l.params) });
    const blockTitle = block != null ? K3.t("layers.block", { block }) : "";
    return `<div class="layer-row" data-layer="${l.index}" data-mixer="${l.mixer || ""}" data-ffn="${l.ffn || ""}" title="${escapeHtml(title)}">
      <div class="block-mark${blockStart ? " start" : ""}${block % 2 ? " odd" : ""}" title="${escapeHtml(blockTitle)}"></div>
      <div class="layer-label">${String(l.index).padStart(2, "\u2007")} <span class="kind-${l.mixer}">${escapeHtml(mixer)}</span> ${escapeHtml(ffn)}</div>
      <div><div class="bar" style="width:${Math.max(0.5, (100 * l.params) / maxParams)}%">${bar}</div></div>
    </div>`;
  });
  const map = document.getElementById("layer-map");
  map.innerHTML = html.join("");
  if (K3.openLayerIndex != null) markOpen(K3.openLayerIndex);
}

function markOpen(index) {
  document.querySelectorAll(".layer-row").forEach((r) => r.classList.toggle("open", Number(r.dataset.layer) === index));
}

// ---- a layer's tensors -----------------------------------------------------------------------------------
const EXPERT_PAGE = 8;

async function openLayer(index, expertFrom = 0) {
  K3.openLayerIndex = index;
  markOpen(index);
  const box = document.getElementById("layer-detail");
  if (K3.summary.kind !== "checkpoint") {
    K3.openLayerDoc = null;
    drawLayerParts();
    return;
  }
  const doc = await K3.get(`api/layer/${index}.json`);
  K3.openLayerDoc = { doc, expertFrom };
  drawLayerDetail();
}
K3.openLayer = openLayer;

/** Config-only view: the open layer's parts and their parameters (there are no tensors to list). */
function drawLayerParts() {
  const l = K3.layers.layers.find((x) => x.index === K3.openLayerIndex);
  if (!l) return;
  const { mixer, ffn } = layerKind(l);
  const rows = PART_ORDER.filter((p) => l.parts[p])
    .map((p) => `<tr><td><i class="p-${p} ${p === "attention" ? l.mixer : ""}" style="display:inline-block;width:.8rem;height:.8rem;border-radius:2px"></i> ${escapeHtml(K3.t(`layers.parts.${p}`))}</td>
      <td class="num">${K3.fmtInt(l.parts[p])}</td><td class="num">${K3.fmtPct(l.parts[p] / l.params, 2)}</td></tr>`)
    .join("");
  document.getElementById("layer-detail").innerHTML = `<h3>${escapeHtml(K3.t("layers.open", { index: l.index, mixer, ffn, params: K3.fmtInt(l.params) }))}</h3>
    <table class="tensors parts"><tbody>${rows}</tbody></table>`;
}

function drawLayerDetail() {
  if (K3.summary.kind !== "checkpoint") return drawLayerParts();
  if (!K3.openLayerDoc) return;
  const { doc, expertFrom } = K3.openLayerDoc;
  const plain = doc.tensors.filter((t) => t.expert == null);
  const experts = doc.tensors.filter((t) => t.expert != null);
  const shown = experts.filter((t) => t.expert >= expertFrom && t.expert < expertFrom + EXPERT_PAGE);
  const maxExpert = Math.max(-1, ...experts.map((t) => t.expert));
  let html = `<h3>${escapeHtml(K3.t("layers.layer", { index: doc.index }))} · ${escapeHtml(K3.t("tensors.pick"))}</h3>`;
  html += tensorTable(plain.concat(shown));
  if (experts.length) {
    html += `<p class="intro">${escapeHtml(K3.t("tensors.experts_rows", { n: K3.fmtInt(experts.length), from: expertFrom, to: Math.min(maxExpert, expertFrom + EXPERT_PAGE - 1) }))}
      <label>${escapeHtml(K3.t("tensors.expert_from"))} <input type="number" id="expert-from" min="0" max="${maxExpert}" value="${expertFrom}" style="width:6rem"></label></p>`;
  }
  const box = document.getElementById("layer-detail");
  box.innerHTML = html;
  const input = document.getElementById("expert-from");
  if (input) input.addEventListener("change", () => openLayer(doc.index, Math.max(0, Math.min(maxExpert, Number(input.value) || 0))));
}

/** A name without its model and layer prefix (`...layers.12.self_attn.q_proj.weight` -> `self_attn.q_proj.weight`). */
function shortName(name) {
  const m = name.match(/(?:^|\.)(?:layers?|h|blocks?)\.\d+\.(.*)$/);
  return m ? m[1] : name;
}

function tensorTable(tensors) {
  const head = ["name", "dtype", "shape", "params", "min", "max", "rms", "zeros", "distinct"]
    .map((k) => `<th>${escapeHtml(K3.t(`tensors.${k}`))}</th>`)
    .join("");
  const rows = tensors.map((t) => {
    const s = t.stats;
    const cells = s
      ? [K3.fmtNum(s.min), K3.fmtNum(s.max), K3.fmtNum(s.rms), K3.fmtPct(s.zero_fraction), K3.fmtInt(s.distinct_values) + (s.distinct_exact ? "" : "+")]
      : [K3.t("tensors.not_scanned"), "", "", "", ""];
    return `<tr data-tensor="${t.id}"><td class="name" title="${escapeHtml(t.name)}">${escapeHtml(shortName(t.name))}</td><td>${t.dtype}</td>
      <td class="num">${t.shape.join("×")}</td><td class="num">${K3.fmtInt(t.params)}</td>${cells.map((c) => `<td class="num">${escapeHtml(c)}</td>`).join("")}</tr>`;
  });
  return `<table class="tensors"><thead><tr>${head}</tr></thead><tbody>${rows.join("")}</tbody></table>`;
}
K3.tensorTable = tensorTable;

// ---- start --------------------------------------------------------------------------------------------
function applyVisibility() {
  const s = K3.summary;
  const weights = s.kind === "checkpoint" && s.tensors > 0;
  document.querySelectorAll(".weights-only").forEach((el) => el.classList.toggle("hidden", !weights));
  document.querySelectorAll(".moe-only").forEach((el) => el.classList.toggle("hidden", !(weights && s.has_experts)));
}

async function drawOtherTensors() {
  if (K3.summary.kind !== "checkpoint") return;
  const doc = await K3.get("api/tensors/other.json");
  const parts = doc.parts || {};
  const inParts = new Set(Object.values(parts).flat().map((t) => t.id));
  let html = tensorTable(doc.tensors.filter((t) => !inParts.has(t.id)));
  for (const [part, tensors] of Object.entries(parts)) {
    html += `<h3>${escapeHtml(K3.t(`tensors.${part}`))}</h3>` + tensorTable(tensors);
  }
  document.getElementById("other-tensors").innerHTML = html;
}

function redrawAll() {
  drawHero();
  drawGuide();
  drawLayerMap();
  drawLayerDetail();
  drawOtherTensors();
}

async function main() {
  let lang = "es";
  try {
    lang = localStorage.getItem("k3-atlas-lang") || (navigator.language || "es").slice(0, 2);
  } catch (e) {
    /* no storage: default language */
  }
  if (lang !== "es" && lang !== "en") lang = "es";
  [K3.summary, K3.layers] = await Promise.all([K3.get("api/summary.json"), K3.get("api/layers.json")]);
  applyVisibility();
  K3.onLanguage(redrawAll);
  document.getElementById("lang").addEventListener("click", (e) => {
    if (e.target.dataset.lang) setLanguage(e.target.dataset.lang);
  });
  const openFromEvent = (e) => {
    const el = e.target.closest("[data-layer]");
    if (el) openLayer(Number(el.dataset.layer));
  };
  document.getElementById("layer-map").addEventListener("click", openFromEvent);
  document.getElementById("rhythm").addEventListener("click", openFromEvent);
  for (const id of ["layer-detail", "other-tensors"]) {
    document.getElementById(id).addEventListener("click", (e) => {
      const row = e.target.closest("[data-tensor]");
      if (row && K3.openTensor) K3.openTensor(Number(row.dataset.tensor), true);
    });
  }
  await setLanguage(lang);
  if (K3.panelsStart) await K3.panelsStart();
  document.body.dataset.ready = "1";
}

main().catch((e) => {
  console.error(e);
  document.getElementById("status-note").textContent = String(e);
});
