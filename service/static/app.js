// The search page: plain DOM + fetch, no framework, no build step, nothing loaded from outside.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    info: $("info"),
    keyForm: $("key-form"),
    keyInput: $("api-key"),
    error: $("error"),
    form: $("search-form"),
    query: $("query"),
    k: $("k"),
    search: $("search"),
    slider: $("slider"),
    sliderLabel: $("slider-label"),
    sliderValue: $("slider-value"),
    sliderHelp: $("slider-help"),
    summary: $("summary"),
    notice: $("notice"),
    timings: $("timings"),
    results: $("results"),
    prev: $("prev"),
    next: $("next"),
    pageLabel: $("page-label"),
    upload: $("upload"),
    preview: $("upload-preview"),
    captionSummary: $("caption-summary"),
    captionNotice: $("caption-notice"),
    imageTimings: $("image-timings"),
    captions: $("caption-results"),
    similarHeading: $("similar-heading"),
    similar: $("similar"),
    labelToggle: $("label-toggle"),
    refit: $("refit"),
    labelCounts: $("label-counts"),
    labelNotice: $("label-notice"),
  };

  const DEBOUNCE_MS = 150;
  const KEY_STORAGE = "icr-api-key"; // this tab only: sessionStorage, never a cookie or the URL
  const state = {
    key: sessionStorage.getItem(KEY_STORAGE) || "",
    calibrated: false,
    maxK: 100,
    depth: 1000,
    maxUpload: null,
    offset: 0,
    query: "",
    shownQuery: "", // the query of the hits in the grid, as the server read it (their labels' query)
    file: null,
    textController: null,
    imageController: null,
    debounce: null,
    previewUrl: null,
  };

  // --- errors -----------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(code, message, status) {
      super(message);
      this.code = code;
      this.status = status;
    }
  }

  // Errors by source ("info", "text", "image"): a success clears its own source's error only, so a
  // good image search does not hide the text search's error that came just before it.
  const errors = new Map();

  function renderErrors() {
    el.error.textContent = Array.from(errors.values()).join("\n");
    el.error.hidden = errors.size === 0;
  }

  function showError(source, err) {
    if (err && err.name === "AbortError") return;
    const code = err && err.code ? err.code : "error";
    const message = err && err.message ? err.message : String(err);
    errors.delete(source); // re-inserted last: the newest message at the bottom
    errors.set(source, `${code}: ${message}`);
    renderErrors();
  }

  function clearError(source) {
    if (errors.delete(source)) renderErrors();
  }

  function keyHeaders() {
    return state.key ? { "X-API-Key": state.key } : {};
  }

  // A keyed server (ICR_API_KEY) answers 401 without a key and 403 with a wrong one: ask for it.
  function askForKey() {
    el.keyForm.hidden = false;
    el.keyInput.focus();
  }

  async function api(path, options = {}) {
    let response;
    const headers = { Accept: "application/json", ...(options.headers || {}), ...keyHeaders() };
    try {
      response = await fetch(path, { ...options, headers });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError("network", `could not reach the server (${err.message}); is \`icr serve\` running?`);
    }
    const text = await response.text();
    let body = null;
    try {
      body = text ? JSON.parse(text) : null;
    } catch (_) {
      body = null;
    }
    if (!response.ok) {
      const code = body && body.error ? body.error : `http_${response.status}`;
      const message =
        body && body.message ? body.message : text.slice(0, 300) || response.statusText || "request failed";
      // Labelling needs admin rights that a read key cannot give: its refusals are shown as a notice
      if ((response.status === 401 || response.status === 403) && !options.noKeyPrompt) askForKey();
      throw new ApiError(code, message, response.status);
    }
    if (body === null) throw new ApiError("bad_response", `${path} answered with something that is not JSON`);
    return body;
  }

  // --- formatting -------------------------------------------------------------------------------
  const fmtScore = (s) => (typeof s === "number" ? s.toFixed(3) : "–");
  const fmtPct = (p) => (typeof p === "number" ? `${(p * 100).toFixed(p >= 0.995 || p < 0.1 ? 1 : 0)}%` : "–");
  const fmtMs = (ms) => (ms >= 100 ? ms.toFixed(0) : ms.toFixed(1));

  function sliderNumber() {
    return Number(el.slider.value);
  }

  function showSliderValue() {
    const v = sliderNumber();
    el.sliderValue.textContent = state.calibrated ? `${v.toFixed(2)} (${Math.round(v * 100)}%)` : v.toFixed(2);
  }

  // At 0 a calibrated slider asks for no threshold: every hit passes relevance >= 0 anyway, and a
  // query the calibration has no evidence for (which min_relevance never passes) still shows its
  // nearest images, with no relevance and the notice saying why.
  function thresholdField() {
    if (!state.calibrated) return { min_score: sliderNumber() };
    return sliderNumber() > 0 ? { min_relevance: sliderNumber() } : {};
  }

  function passedText(r) {
    const t = r.threshold || {};
    if (t.kind === "none") return `${r.passed} results (no threshold)`;
    const what = t.kind === "min_relevance" ? `relevance >= ${Number(t.value).toFixed(2)}` : null;
    let text;
    const evidence = (r.quality || {}).evidence;
    if (t.kind === "min_relevance" && evidence && !evidence.inside) {
      text = `${r.passed} passed the threshold (no relevance is given for this query: see below)`;
    } else if (t.score === null || t.score === undefined) {
      text = `${r.passed} passed the threshold (no score reaches ${what || "it"})`;
    } else {
      text = `${r.passed} passed the threshold (score >= ${Number(t.score).toFixed(3)}${what ? `, ${what}` : ""})`;
    }
    if (!r.passed_is_exact) {
      text += ` — all ${r.searched} nearest searched passed, so more beyond the search depth may pass too`;
    }
    return text;
  }

  function timingsText(t) {
    if (!t) return "";
    return (
      `encode ${fmtMs(t.encode_ms)} ms · search ${fmtMs(t.search_ms)} ms · filter ${fmtMs(t.filter_ms)} ms · ` +
      `metadata ${fmtMs(t.metadata_ms)} ms · total ${fmtMs(t.total_ms)} ms`
    );
  }

  function node(tag, className, text) {
    const n = document.createElement(tag);
    if (className) n.className = className;
    if (text !== undefined) n.textContent = text;
    return n;
  }

  // What the calibration says about this query's results (expected precision, query kind) and the
  // server's warnings, above the results: a warning style when there are warnings.
  function renderNotice(box, r) {
    const quality = r.quality || {};
    const warnings = Array.isArray(quality.warnings) ? quality.warnings : [];
    const facts = [];
    if (typeof r.expected_precision === "number") {
      facts.push(`Expected precision of these results: ${fmtPct(r.expected_precision)}`);
    }
    if (typeof r.expected_relevant === "number" && r.passed > 0) {
      facts.push(`about ${r.expected_relevant.toFixed(1)} of the ${r.passed} that passed are likely relevant`);
    }
    if (quality.kind) {
      const p10 = typeof quality.kind_p_at_10 === "number" ? ` (held-out P@10 ${quality.kind_p_at_10.toFixed(2)})` : "";
      facts.push(`query kind: ${quality.kind.replace(/_/g, " ")}${p10}`);
    }
    box.replaceChildren();
    box.dataset.level = warnings.length ? "warn" : "info";
    box.dataset.warnings = String(warnings.length);
    box.dataset.kind = quality.kind || "";
    box.dataset.expectedPrecision = typeof r.expected_precision === "number" ? String(r.expected_precision) : "";
    // outside the calibration's evidence: no relevance at all, said first (the reason is the first warning)
    const evidence = quality.evidence;
    box.dataset.evidence = evidence ? (evidence.inside ? "inside" : "outside") : "";
    if (evidence && !evidence.inside) {
      facts.unshift("No relevance for this query: the calibration has no evidence for queries like it");
    }
    if (!facts.length && !warnings.length) {
      box.hidden = true;
      return;
    }
    if (facts.length) box.append(node("p", "notice-facts", facts.join(" · ")));
    if (warnings.length) {
      const list = node("ul", "notice-warnings");
      for (const w of warnings) list.append(node("li", "notice-warning", w));
      box.append(list);
    }
    box.hidden = false;
  }

  // --- info -------------------------------------------------------------------------------------
  function objectiveName(objective) {
    if (!objective) return "unknown objective";
    if (typeof objective === "string") return objective;
    return objective.name || JSON.stringify(objective);
  }

  function infoText(info) {
    const idx = info.index || {};
    const parts = [`model: ${objectiveName(info.checkpoint && info.checkpoint.objective)}`];
    let images = `${idx.ntotal} images indexed`;
    if (idx.gallery_count !== undefined) {
      images += ` (${idx.gallery_count} gallery + ${idx.distractor_count || 0} distractors)`;
    }
    parts.push(images);
    parts.push(info.caption_index ? `${info.caption_index.ntotal} captions` : "no caption index");
    const cal = info.calibration;
    if (cal) {
      // The held-out figure is the honest one: the evaluation's ECE of the served map, else (format 1
      // files) the ECE per split, {"val": fit split, "test": held out}.
      let ece = "";
      const maps = cal.evaluation && cal.evaluation.maps;
      const served = maps && maps[cal.method];
      if (served && typeof served.ece === "number") ece = `, held-out ECE ${served.ece.toFixed(3)}`;
      else if (typeof cal.ece === "number") ece = `, ECE ${cal.ece.toFixed(3)}`;
      else if (cal.ece && typeof cal.ece === "object") {
        const splits = Object.entries(cal.ece).filter(([, v]) => typeof v === "number");
        if (splits.length) ece = `, ECE ${splits.map(([k, v]) => `${k} ${v.toFixed(3)}`).join(" / ")}`;
      }
      const method = cal.method === "per_query" ? "per-query" : cal.method;
      parts.push(`calibrated (${method}${ece})`);
    } else {
      parts.push("no calibration: thresholds are raw cosine scores");
    }
    return parts.join(" · ");
  }

  function configureSlider(info) {
    state.calibrated = Boolean(info.calibration);
    if (state.calibrated) {
      el.slider.min = "0";
      el.slider.max = "1";
      el.slider.value = "0.5";
      el.sliderLabel.textContent = "Minimum relevance";
      el.sliderHelp.textContent =
        "Calibrated probability that an image matches the caption; images below it are hidden.";
    } else {
      el.slider.min = "-1";
      el.slider.max = "1";
      el.slider.value = "0";
      el.sliderLabel.textContent = "Minimum cosine score";
      el.sliderHelp.textContent =
        "This index has no calibration (run `icr index calibrate`), so the threshold is the raw cosine score.";
    }
    el.slider.step = "0.01";
    el.slider.disabled = false;
    showSliderValue();
  }

  function configureLimits(limits) {
    if (!limits) return;
    state.maxK = limits.max_k || state.maxK;
    state.depth = limits.search_depth || state.depth;
    state.maxUpload = limits.max_upload_bytes || null;
    const cap = Math.min(state.maxK, state.depth);
    for (const option of Array.from(el.k.options)) {
      if (Number(option.value) > cap) option.remove();
    }
    if (el.k.options.length === 0) el.k.add(new Option(String(cap), String(cap), true, true));
  }

  async function loadInfo() {
    try {
      const info = await api("/v1/info");
      configureSlider(info);
      configureLimits(info.limits);
      el.info.textContent = infoText(info);
      el.info.dataset.state = "ready";
      if (!info.caption_index) {
        el.upload.title = "No caption index is loaded: uploads return similar images only.";
      }
      if (info.checkpoint && info.checkpoint.accepts_images === false) {
        el.upload.disabled = true;
        el.upload.title = "This checkpoint reads precomputed features, not pixels: no image search.";
      }
      clearError("info");
    } catch (err) {
      el.info.dataset.state = "error";
      el.info.textContent = "The index description is not available yet.";
      showError("info", err);
      if (err.status === 503 || err.code === "network") setTimeout(loadInfo, 3000); // still loading
      if (err.status === 401 || err.status === 403) el.info.textContent = "Enter this server's API key.";
    }
  }

  // An <img src> cannot send the key: with one, fetch the image with it and show a blob URL.
  async function setImage(img, url) {
    if (!state.key) {
      img.src = url;
      return;
    }
    try {
      const response = await fetch(url, { headers: keyHeaders() });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const blobUrl = URL.createObjectURL(await response.blob());
      img.addEventListener("load", () => URL.revokeObjectURL(blobUrl), { once: true });
      img.src = blobUrl;
    } catch (_) {
      img.dispatchEvent(new Event("error"));
    }
  }

  // --- result cards -----------------------------------------------------------------------------
  function card(hit) {
    const item = node("figure", "hit");
    item.setAttribute("role", "listitem");
    item.dataset.id = String(hit.id);
    item.dataset.score = String(hit.score);
    item.dataset.relevance = hit.relevance === null || hit.relevance === undefined ? "" : String(hit.relevance);
    const captions = (hit.metadata && hit.metadata.captions) || [];
    const caption = captions.length ? captions[0] : "";
    if (caption) item.title = caption;

    if (hit.image_url) {
      const img = document.createElement("img");
      setImage(img, `${hit.image_url}?size=thumb`);
      img.alt = caption || `image ${hit.id}`;
      img.decoding = "async";
      img.addEventListener("load", () => {
        if (img.naturalWidth < 96) img.classList.add("pixelated"); // tiny images: no blur when scaled up
      });
      img.addEventListener("error", () => {
        img.replaceWith(node("div", "placeholder", "image unavailable"));
      });
      item.append(img);
    } else {
      item.append(node("div", "placeholder", "no pixels (precomputed features)"));
    }

    const meta = node("figcaption", "meta");
    const line = node("div", "line");
    line.append(node("span", "rank", `#${hit.rank}`));
    line.append(node("span", "score", fmtScore(hit.score)));
    if (hit.relevance !== null && hit.relevance !== undefined) {
      const rel = node("span", "relevance", fmtPct(hit.relevance));
      rel.title = "calibrated probability of relevance";
      line.append(rel);
    }
    if (hit.is_distractor) line.append(node("span", "badge", "distractor"));
    meta.append(line);
    if (caption) meta.append(node("div", "caption", caption));
    item.append(meta);
    return item;
  }

  // --- labelling -------------------------------------------------------------------------------
  // With "Label hits" on, each text-search hit gets two buttons that record a judgement (POST
  // /v1/feedback, admin rights); the line below the toggle says what the labels hold and support
  // (GET /v1/feedback), and "Refit" fits the calibration on them (POST /v1/feedback/refit). Hits
  // judged before (another search, page or visit) show their labels (GET /v1/feedback/labels).
  function showLabelNotice(text, level, stateName) {
    el.labelNotice.replaceChildren(node("p", "notice-facts", text));
    el.labelNotice.dataset.level = level;
    el.labelNotice.dataset.state = stateName;
    el.labelNotice.hidden = false;
  }

  function supportsText(supports) {
    if (!supports) return "";
    const parts = [];
    for (const [target, t] of Object.entries(supports.thresholds || {})) {
      if (t.reached) {
        const more = t.more_labels > 0 ? `; ~${t.more_labels} more labels for ±0.05` : "; within ±0.05";
        parts.push(
          `relevance ${target}: from score ${fmtScore(t.score)} (${t.labels_above} labels above, ` +
            `${fmtPct(t.precision_above)} relevant${more})`
        );
      } else {
        const best = typeof t.best_bound === "number" ? ` (best bound ${t.best_bound.toFixed(2)})` : "";
        parts.push(`relevance ${target}: not reached${best}`);
      }
    }
    return ` The served calibration is fitted on ${supports.used} of them: ${parts.join(" · ")}.`;
  }

  function showCounts(counts, supports) {
    el.labelCounts.dataset.judgements = String(counts.judgements);
    el.labelCounts.dataset.relevant = String(counts.relevant);
    el.labelCounts.textContent =
      `Labels on this index: ${counts.judgements} judgements on ${counts.hits} hits of ` +
      `${counts.queries} queries, ${counts.relevant} relevant.` + supportsText(supports);
    el.labelCounts.hidden = false;
  }

  async function loadFeedback() {
    try {
      const f = await api("/v1/feedback");
      showCounts(f.counts, f.supports);
      if (!f.can_label) {
        showLabelNotice(
          "This browser has no admin rights on this server: labels are refused (enter the admin key " +
            "above, or open the page on the server's machine).",
          "warn",
          "no-rights"
        );
      }
      clearError("feedback");
    } catch (err) {
      showError("feedback", err);
    }
  }

  function labelButtons(item, hit, query) {
    const row = node("div", "label-row");
    const yes = node("button", "label-yes", "✓ relevant");
    const no = node("button", "label-no", "✗ not relevant");
    for (const [button, relevant] of [[yes, true], [no, false]]) {
      button.type = "button";
      button.setAttribute("aria-pressed", "false");
      button.title = relevant ? "This image matches the query" : "This image does not match the query";
      button.addEventListener("click", () => label(item, query, hit.id, relevant, yes, no));
      row.append(button);
    }
    const count = node("span", "label-count");
    count.hidden = true;
    row.append(count);
    item.append(row);
    return item;
  }

  const verdict = (relevant) => (relevant ? "relevant" : "not-relevant");

  // A hit's stored label: the pressed button is your own verdict where you gave one, else the
  // majority's; the count beside it is every judge's (✓ relevant, ✗ not relevant).
  function markLabel(item, l) {
    const shown = l.mine === null || l.mine === undefined ? l.relevant : l.mine;
    item.dataset.label = verdict(shown);
    item.dataset.majority = verdict(l.relevant);
    item.dataset.mine = l.mine === null || l.mine === undefined ? "" : verdict(l.mine);
    item.dataset.judgements = String(l.judgements);
    item.querySelector(".label-yes").setAttribute("aria-pressed", String(shown));
    item.querySelector(".label-no").setAttribute("aria-pressed", String(!shown));
    const count = item.querySelector(".label-count");
    const against = l.judgements - l.relevant_judgements;
    count.textContent = `✓${l.relevant_judgements} ✗${against}`;
    count.title =
      `${l.judgements} judgement${l.judgements === 1 ? "" : "s"}, ${l.relevant_judgements} relevant: ` +
      `labelled ${l.relevant ? "relevant" : "not relevant"} by majority (a tie counts as not relevant)` +
      (item.dataset.mine ? `; yours: ${l.mine ? "relevant" : "not relevant"}` : "");
    count.hidden = false;
  }

  // The labels already given to these hits of the query, shown on them. Cards replaced meanwhile
  // (a newer search) are no longer in the grid: marking them changes nothing shown.
  async function loadLabels(query, items) {
    if (!query || !items.length) return false;
    const params = new URLSearchParams({ query });
    for (const item of items) params.append("image_id", item.dataset.id);
    try {
      const r = await api(`/v1/feedback/labels?${params}`);
      const byId = new Map(r.labels.map((l) => [String(l.image_id), l]));
      for (const item of items) {
        const l = byId.get(item.dataset.id);
        if (l && item.dataset.label !== "saving") markLabel(item, l);
      }
      clearError("labels");
      return true;
    } catch (err) {
      showError("labels", err);
      return false;
    }
  }

  // The grid's data-labels turns "shown" once the labels of the hits it still shows are marked.
  async function loadShownLabels() {
    const items = Array.from(el.results.querySelectorAll(".hit"));
    const shown = await loadLabels(state.shownQuery, items);
    if (shown && items.every((item) => item.parentNode === el.results)) el.results.dataset.labels = "shown";
  }

  async function label(item, query, imageId, relevant, yes, no) {
    item.dataset.label = "saving";
    try {
      const r = await api("/v1/feedback", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ query, image_id: imageId, relevant }),
        noKeyPrompt: true,
      });
      item.dataset.label = verdict(relevant);
      yes.setAttribute("aria-pressed", String(relevant));
      no.setAttribute("aria-pressed", String(!relevant));
      showCounts(r.counts, null);
      el.labelNotice.hidden = true;
      loadFeedback(); // what the served calibration supports, beside the new counts
      loadLabels(query, [item]); // this hit's count, with every judge's verdict
    } catch (err) {
      item.dataset.label = "error";
      const rights = err.status === 401 || err.status === 403;
      showLabelNotice(`${rights ? "Not recorded (admin rights needed)" : "Not recorded"}: ${err.message}`, "warn", "refused");
    }
  }

  async function refit() {
    el.refit.disabled = true;
    const caption = el.refit.textContent;
    el.refit.textContent = "Refitting…";
    showLabelNotice("Fitting the calibration on the labels…", "info", "running");
    try {
      const r = await api("/v1/feedback/refit", { method: "POST", noKeyPrompt: true });
      showCounts(r.counts, r.supports);
      const seconds = r.seconds < 1 ? r.seconds.toFixed(2) : r.seconds.toFixed(1);
      showLabelNotice(
        `Refitted in ${seconds} s on ${r.counts.hits} labelled hits; the new calibration is served ` +
          "(what it supports: the line above).",
        "info",
        "done"
      );
      const threshold = el.slider.value; // the user's threshold stays across the new calibration
      const wasCalibrated = state.calibrated;
      await loadInfo();
      if (wasCalibrated && state.calibrated) {
        el.slider.value = threshold;
        showSliderValue();
      }
      if (state.query) runText(); // the hits' relevance under the new calibration
    } catch (err) {
      showLabelNotice(`Refit refused: ${err.message}`, "warn", "error");
    } finally {
      el.refit.disabled = false;
      el.refit.textContent = caption;
    }
  }

  // --- text search ------------------------------------------------------------------------------
  function updatePager(r) {
    const k = r ? r.k : Number(el.k.value);
    if (!r || r.passed === 0 || r.hits.length === 0) {
      el.pageLabel.textContent = "";
      el.prev.disabled = true;
      el.next.disabled = true;
      return;
    }
    const first = r.offset + 1;
    const last = r.offset + r.hits.length;
    el.pageLabel.textContent = `${first}–${last} of ${r.passed}${r.passed_is_exact ? "" : "+"}`;
    el.prev.disabled = r.offset === 0;
    // The server serves offset <= search depth - max k; beyond that, a higher threshold narrows instead.
    el.next.disabled = last >= r.passed || r.offset + k > state.depth - state.maxK;
  }

  async function runText() {
    const text = el.query.value.trim();
    if (!text) return;
    state.query = text;
    if (state.textController) state.textController.abort();
    const controller = new AbortController();
    state.textController = controller;
    const threshold = thresholdField();
    const asked = sliderNumber(); // the slider value this request answers (0: no threshold sent)
    const body = { text, k: Number(el.k.value), offset: state.offset, ...threshold };
    el.results.dataset.state = "loading";
    el.results.setAttribute("aria-busy", "true");
    try {
      const r = await api("/v1/search/text", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (controller !== state.textController) return; // a newer request owns the grid
      clearError("text");
      el.results.replaceChildren(...r.hits.map((hit) => labelButtons(card(hit), hit, r.query)));
      state.shownQuery = r.query;
      el.results.dataset.labels = "";
      if (el.labelToggle.checked) loadShownLabels();
      el.summary.textContent = passedText(r);
      el.summary.dataset.passed = String(r.passed);
      renderNotice(el.notice, r);
      el.timings.textContent = timingsText(r.timings);
      updatePager(r);
      el.results.dataset.threshold = String(asked);
      el.results.dataset.offset = String(r.offset);
      el.results.dataset.state = "done";
    } catch (err) {
      if (err.name === "AbortError" || controller !== state.textController) return;
      el.results.dataset.state = "error";
      showError("text", err);
    } finally {
      if (controller === state.textController) el.results.removeAttribute("aria-busy");
    }
  }

  // --- image search -----------------------------------------------------------------------------
  function captionItem(hit) {
    const li = node("li", "caption-hit");
    li.dataset.id = String(hit.id);
    li.dataset.score = String(hit.score);
    li.dataset.relevance = hit.relevance === null || hit.relevance === undefined ? "" : String(hit.relevance);
    li.append(node("span", "caption-text", hit.caption || "(empty caption)"));
    const nums = node("span", "caption-nums");
    nums.append(node("span", "score", fmtScore(hit.score)));
    if (hit.relevance !== null && hit.relevance !== undefined) nums.append(node("span", "relevance", fmtPct(hit.relevance)));
    li.append(nums);
    return li;
  }

  async function runImage() {
    const file = state.file;
    if (!file) return;
    if (state.maxUpload && file.size > state.maxUpload) {
      showError(
        "image",
        new ApiError("payload_too_large", `${file.name}: ${file.size} bytes, the server takes at most ${state.maxUpload}; send a smaller image`),
      );
      return;
    }
    if (state.imageController) state.imageController.abort();
    const controller = new AbortController();
    state.imageController = controller;
    const form = new FormData();
    form.append("file", file, file.name);
    form.append("k", el.k.value);
    form.append("offset", "0");
    const asked = sliderNumber(); // the slider value this request answers (0: no threshold sent)
    for (const [field, value] of Object.entries(thresholdField())) form.append(field, String(value));
    form.append("include_images", "true");
    el.captions.dataset.state = "loading";
    el.captions.setAttribute("aria-busy", "true");
    try {
      const r = await api("/v1/search/image", { method: "POST", body: form, signal: controller.signal });
      if (controller !== state.imageController) return;
      clearError("image");
      el.captions.replaceChildren(...r.hits.map(captionItem));
      el.captionSummary.textContent = `Captions: ${passedText(r)}`;
      el.captionSummary.dataset.passed = String(r.passed);
      renderNotice(el.captionNotice, r);
      el.imageTimings.textContent = timingsText(r.timings);
      const similar = r.similar_images;
      el.similar.replaceChildren(...(similar ? similar.hits.map(card) : []));
      el.similarHeading.hidden = !similar;
      if (similar) el.similarHeading.textContent = `Similar images: ${passedText(similar)}`;
      el.captions.dataset.threshold = String(asked);
      el.captions.dataset.state = "done";
    } catch (err) {
      if (err.name === "AbortError" || controller !== state.imageController) return;
      el.captions.dataset.state = "error";
      showError("image", err);
    } finally {
      if (controller === state.imageController) el.captions.removeAttribute("aria-busy");
    }
  }

  // --- wiring -----------------------------------------------------------------------------------
  function rerun() {
    state.offset = 0;
    runText();
    runImage();
  }

  el.form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (!el.query.value.trim()) {
      showError("text", new ApiError("invalid_request", "type a caption to search for"));
      el.query.focus();
      return;
    }
    state.offset = 0;
    runText();
  });

  el.slider.addEventListener("input", () => {
    showSliderValue();
    clearTimeout(state.debounce);
    state.debounce = setTimeout(rerun, DEBOUNCE_MS);
  });
  el.slider.addEventListener("change", () => {
    showSliderValue();
    clearTimeout(state.debounce);
    state.debounce = setTimeout(rerun, DEBOUNCE_MS);
  });

  el.k.addEventListener("change", rerun);

  el.prev.addEventListener("click", () => {
    state.offset = Math.max(0, state.offset - Number(el.k.value));
    runText();
  });
  el.next.addEventListener("click", () => {
    state.offset += Number(el.k.value);
    runText();
  });

  el.upload.addEventListener("change", () => {
    const file = el.upload.files && el.upload.files[0];
    if (!file) return;
    state.file = file;
    if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
    state.previewUrl = URL.createObjectURL(file);
    el.preview.src = state.previewUrl;
    el.preview.hidden = false;
    runImage();
  });

  el.labelToggle.addEventListener("change", () => {
    const on = el.labelToggle.checked;
    el.results.dataset.labelling = on ? "on" : "off";
    el.refit.hidden = !on;
    if (on) {
      loadFeedback();
      loadShownLabels();
    } else {
      el.labelCounts.hidden = true;
      el.labelNotice.hidden = true;
    }
  });
  el.refit.addEventListener("click", refit);

  el.keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = el.keyInput.value.trim();
    sessionStorage.setItem(KEY_STORAGE, state.key);
    el.keyForm.hidden = true;
    errors.clear();
    renderErrors();
    loadInfo();
    if (state.query) runText();
    if (state.file) runImage();
  });

  showSliderValue();
  loadInfo();
})();
