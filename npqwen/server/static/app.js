// The npqwen page: a chat over /v1/chat/completions (streamed), and for any generated token the
// alternatives the model had at that step (logprobs) and where it was looking (/v1/npqwen/attention);
// for a Qwen3-MoE, also which experts the token itself went to in each layer (/v1/npqwen/experts);
// with `npqwen serve --sae`, the token's strongest SAE features and where each fires (/v1/npqwen/features).
//
// Model text only ever reaches the page as textContent or through Markdown.render (markdown.js),
// which builds DOM nodes from it: no innerHTML with anything the model or the server wrote.
"use strict";

const $ = (id) => document.getElementById(id);

// Everything the page knows, in one object (also handy in the browser's console: window.npqwen).
const state = {
  apiKey: "",            // typed in Settings; kept in this page only
  model: null,           // the served model's id, from /v1/models
  history: [],           // the messages sent back on the next turn: {role, content}, no reasoning
  answers: [],           // one record per assistant answer (see newAnswer)
  controller: null,      // the AbortController of the request in flight
  inspected: null,       // {answer, index}: the token shown in the inspector
  attention: null,       // the last /v1/npqwen/attention response shown
  layers: null,          // the model's layer and head counts, once an attention call told them
  heads: null,
  features: null,        // the last /v1/npqwen/features response shown
};
window.npqwen = state;

// -- talking to the server --

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.apiKey) h.Authorization = "Bearer " + state.apiKey;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return response.status + " " + response.statusText;
}

async function api(path, body) {
  const sent = headers();
  const response = await fetch(path, body === undefined ? { headers: sent }
    : { method: "POST", headers: sent, body: JSON.stringify(body) });
  if (!response.ok) throw await apiError(response, sent);
  return response.json();
}

// The error of a refused request; a 401 asks for the key (`sent`: the request's headers, which
// tell a missing key from a refused one).
async function apiError(response, sent) {
  const error = new Error(await errorMessage(response));
  error.status = response.status;
  if (response.status === 401) askForKey(Boolean(sent.Authorization));
  return error;
}

// Server-sent events of a fetch response: each `data: {json}` parsed, until `data: [DONE]`.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// npqwen's built-in models (npqwen/tiny.py, served under their own names): random weights, meaningless text
const BUILT_IN_MODELS = ["tiny", "tiny-moe", "tiny-embedding", "tiny-reranker", "tiny-qwen3.5", "tiny-qwen4-exp"];

async function loadModel() {
  try {
    const models = await api("v1/models");
    state.model = models.data[0].id;
    const builtIn = BUILT_IN_MODELS.includes(state.model);
    $("model-name").textContent = state.model + (builtIn ? " (random weights: its text is meaningless)" : "");
    $("model-name").title = builtIn ? "a built-in model of npqwen/tiny.py, for stepping through the code" : "";
    showNotice("");
  } catch (e) {
    if (e.status !== 401) showNotice("Cannot reach the server: " + e.message);
  }
}

function askForKey(refused) {
  showNotice(refused ? "The server refused this API key: check it in Settings."
    : "This server needs an API key: type it in Settings (it stays in this page).");
  toggleSettings(true);
  $("api-key").focus();
}

function showNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

// -- the chat --

function settings() {
  const number = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value));
  const body = {
    temperature: number("temperature"),
    top_p: number("top-p"),
    top_k: number("top-k"),
    max_tokens: number("max-tokens"),
    chat_template_kwargs: { enable_thinking: $("thinking").checked },
    // speculative decoding: the drafts and which were kept come back per token (choice.speculative)
    speculative: $("drafts").value ? { method: $("drafts").value, k: number("draft-k") || 4 } : undefined,
  };
  return Object.fromEntries(Object.entries(body).filter(([, v]) => v !== undefined));
}

function addMessage(role) {
  $("empty").hidden = true;
  const node = document.createElement("div");
  node.className = "msg " + role;
  $("messages").append(node);
  return node;
}

function newAnswer() {
  const node = addMessage("assistant");
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Thinking…";
  const reasoningText = document.createElement("div");
  reasoningText.className = "reasoning-text";
  reasoning.append(summary, reasoningText);
  const body = document.createElement("div");
  body.className = "answer";
  const tokens = document.createElement("div");
  tokens.className = "tokens";
  tokens.hidden = true;
  const footer = document.createElement("div");
  footer.className = "msg-footer";
  const stats = document.createElement("span");
  stats.className = "stats";
  const toggle = document.createElement("button");
  toggle.type = "button";
  toggle.className = "tokens-toggle";
  toggle.textContent = "Tokens";
  toggle.disabled = true;
  footer.append(stats, toggle);
  node.append(reasoning, body, tokens, footer);
  node.dataset.state = "streaming";
  const answer = {
    node, reasoning, summary, reasoningText, body, tokens, footer, stats, toggle,
    reasoningSoFar: "", content: "", rendered: null,
    promptIds: [],       // the prompt as the model read it (prompt_token_ids)
    generated: [],       // per token: {id, text, logprob, top: [{id, text, logprob}], draft, accepted}
    sent: 0, firstToken: 0, lastToken: 0, thinkingUntil: 0, drawScheduled: false,
  };
  toggle.addEventListener("click", () => showTokens(answer, answer.tokens.hidden));
  state.answers.push(answer);
  return answer;
}

async function send(text) {
  if (state.controller || !text.trim()) return;
  if (!state.model) await loadModel();
  if (!state.model) return;   // the notice says why; the text stays in the box
  $("prompt").value = "";
  addMessage("user").textContent = text;
  const history = state.history;   // this conversation's, even if New chat is pressed meanwhile
  history.push({ role: "user", content: text });
  const answer = newAnswer();
  const controller = state.controller = new AbortController();
  setBusy(true);
  const body = {
    model: state.model, messages: history, stream: true, return_token_ids: true,
    logprobs: true, top_logprobs: Math.max(1, Math.min(20, Number($("top-logprobs").value) || 5)),
    ...settings(),
  };
  answer.sent = performance.now();
  let finish = "done";
  try {
    const sent = headers();
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: sent, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw await apiError(response, sent);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      take(answer, chunk);
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      finish = "error";
      const error = document.createElement("p");
      error.className = "error";
      error.textContent = e.message;
      answer.footer.before(error);   // in the card, above its footer
    }
  }
  if (finish === "error" && !answer.generated.length) {
    history.pop();   // unanswered: not sent again
  } else {
    history.push({ role: "assistant", content: answer.content });   // a stopped answer as far as it got
  }
  state.controller = null;
  answer.node.dataset.state = finish;
  draw(answer);
  setBusy(false);
}

// One streamed chunk: ids, logprobs and deltas of the answer.
function take(answer, chunk) {
  if (chunk.prompt_token_ids) answer.promptIds = chunk.prompt_token_ids;
  for (const choice of chunk.choices || []) {
    const ids = choice.token_ids || [];
    const entries = (choice.logprobs && choice.logprobs.content) || [];
    const drafts = choice.speculative || [];   // per token: the draft verified at its place, and whether it was kept
    ids.forEach((id, i) => {
      const entry = entries[i] || { token: "", logprob: null, top_logprobs: [] };
      const drafted = drafts[i] || { draft: null, accepted: false };
      answer.generated.push({
        id, text: entry.token, bytes: entry.bytes, logprob: entry.logprob,
        top: (entry.top_logprobs || []).map((t) => ({ text: t.token, bytes: t.bytes, logprob: t.logprob })),
        draft: drafted.draft, accepted: drafted.accepted,
      });
    });
    if (ids.length) {
      const now = performance.now();
      if (!answer.firstToken) answer.firstToken = now;
      answer.lastToken = now;
    }
    const delta = choice.delta || {};
    if (delta.reasoning_content) answer.reasoningSoFar += delta.reasoning_content;
    if (delta.content) {
      if (!answer.thinkingUntil) answer.thinkingUntil = performance.now();
      answer.content += delta.content;
    }
  }
  if (!answer.drawScheduled) {   // at most one redraw per frame, however fast the tokens come
    answer.drawScheduled = true;
    requestAnimationFrame(() => { answer.drawScheduled = false; draw(answer); });
  }
}

function draw(answer) {
  const streaming = answer.node.dataset.state === "streaming";
  const atBottom = window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 60;
  if (answer.reasoningSoFar) {
    answer.reasoning.hidden = false;
    answer.reasoningText.textContent = answer.reasoningSoFar.trim();
    const seconds = ((answer.thinkingUntil || performance.now()) - answer.sent) / 1000;
    answer.summary.textContent = streaming && !answer.thinkingUntil ? "Thinking…"
      : `Reasoning (${seconds.toFixed(1)} s)`;
  }
  if (answer.rendered !== answer.content) {   // nodes are rebuilt only when there is new text
    answer.body.replaceChildren(Markdown.render(answer.content));
    answer.rendered = answer.content;
  }
  if (!answer.tokens.hidden) drawTokens(answer);
  const n = answer.generated.length;
  const parts = [];
  if (answer.firstToken) parts.push(`first token ${((answer.firstToken - answer.sent) / 1000).toFixed(2)} s`);
  if (n > 1 && answer.lastToken > answer.firstToken) {
    parts.push(`${((n - 1) / ((answer.lastToken - answer.firstToken) / 1000)).toFixed(1)} tokens/s`);
  }
  parts.push(`${n} tokens`);
  const drafted = answer.generated.filter((t) => t.draft !== null && t.draft !== undefined);
  if (drafted.length) {   // speculative decoding: the drafts verified at a token's place, and those kept
    parts.push(`${drafted.filter((t) => t.accepted).length} of ${drafted.length} drafts accepted`);
  }
  if (answer.node.dataset.state === "stopped") parts.push("stopped");
  answer.stats.textContent = parts.join(" · ");
  answer.toggle.disabled = !n;
  if (streaming && atBottom) answer.node.scrollIntoView({ block: "end" });   // follow, unless scrolled up
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
  if (!busy) $("prompt").focus();
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.history = [];
  state.answers = [];
  closeInspector();
  $("messages").replaceChildren($("empty"));
  $("empty").hidden = false;
  $("prompt").value = "";
}

function toggleSettings(open) {
  const panel = $("settings");
  panel.hidden = open === undefined ? !panel.hidden : !open;
  $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
}

// -- tokens --

// A token's text as shown: line breaks and tabs made visible, other control characters as \xNN,
// and a token that is part of a UTF-8 character (decoded as U+FFFD) as its bytes, when known.
function shown(text, bytes) {
  if (bytes && text.includes("\uFFFD")) return bytes.map((b) => "\\x" + b.toString(16).padStart(2, "0")).join("");
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "→\t")
    .replace(/[\x00-\x08\x0b-\x1f\x7f]/g, (c) => "\\x" + c.charCodeAt(0).toString(16).padStart(2, "0"));
}

function probabilityColor(p) {
  // a likely token stays plain; the less likely, the warmer its background
  return `rgba(245, 158, 11, ${(0.55 * (1 - p)).toFixed(3)})`;
}

function showTokens(answer, on) {
  answer.tokens.hidden = !on;
  answer.body.hidden = on;
  answer.reasoning.classList.toggle("dim", on);
  answer.toggle.textContent = on ? "Text" : "Tokens";
  if (on) drawTokens(answer);
}

function drawTokens(answer) {
  if (answer.tokens.childElementCount === answer.generated.length) return;
  const spans = answer.generated.map((t, i) => {
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = shown(t.text, t.bytes);
    span.dataset.index = i;
    span.dataset.id = t.id;
    if (t.logprob !== null) {
      const p = Math.exp(t.logprob);
      span.style.background = probabilityColor(p);
      span.title = `p = ${p.toFixed(4)}`;
    }
    if (t.draft !== null && t.draft !== undefined) {   // speculative decoding: a draft was verified here
      span.classList.add(t.accepted ? "draft-accepted" : "draft-refused");
      span.dataset.draft = t.draft;
      span.title += (span.title ? " · " : "") + (t.accepted ? "drafted and accepted"
        : `the draft (id ${t.draft}) was refused: the model's own token`);
    }
    if (isInspected(answer, i)) span.classList.add("selected");
    span.tabIndex = 0;
    span.addEventListener("click", () => inspect(answer, i));
    span.addEventListener("keydown", (e) => {
      if (e.key === "Enter" || e.key === " ") {
        e.preventDefault();
        inspect(answer, i);
      }
    });
    return span;
  });
  answer.tokens.replaceChildren(...spans);
}

// -- the inspector: alternatives and attention --

function isInspected(answer, index) {
  return state.inspected !== null && state.inspected.answer === answer && state.inspected.index === index;
}

function inspect(answer, index) {
  state.inspected = { answer, index };
  document.querySelectorAll(".tok.selected").forEach((s) => s.classList.remove("selected"));
  const span = answer.tokens.querySelector(`.tok[data-index="${index}"]`);
  if (span) span.classList.add("selected");
  $("inspector").hidden = false;
  document.body.classList.add("inspecting");
  if (span) keepInSight(span);
  const token = answer.generated[index];
  const chosen = $("chosen");
  const code = document.createElement("code");
  code.textContent = shown(token.text, token.bytes);
  chosen.replaceChildren(`Token ${index + 1} of the answer: `, code,
    token.logprob === null ? "" : ` with probability ${(100 * Math.exp(token.logprob)).toFixed(2)}\u00a0%`);
  drawAlternatives(token);
  loadAttention();
  loadSaliency();
  loadLayers();
  loadExperts();
  loadFeatures();
}

// The inspector floats over the page, so opening it moves nothing under the pointer. Beside a
// wide screen's chat it covers nothing; on a narrower one it goes to the side away from the
// clicked token; on a phone it is a sheet over the bottom half, and the token scrolls above it
// (style.css gives the page the sheet's height as scroll-padding-bottom).
function keepInSight(span) {
  const inspector = $("inspector");
  inspector.classList.remove("left");
  inspector.classList.toggle("left", span.getBoundingClientRect().right > inspector.getBoundingClientRect().left);
  span.scrollIntoView({ block: "nearest" });
}

function drawAlternatives(token) {
  const rows = token.top.map((alt) => {
    const p = Math.exp(alt.logprob);
    const li = document.createElement("li");
    li.dataset.token = alt.text;
    li.dataset.prob = String(p);
    if (alt.text === token.text && String(alt.bytes) === String(token.bytes)) li.classList.add("chosen");
    const label = document.createElement("code");
    label.textContent = shown(alt.text, alt.bytes);
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = (100 * p).toFixed(2) + "%";
    bar.append(fill);
    const value = document.createElement("span");
    value.className = "prob";
    value.textContent = (100 * p).toFixed(2) + "\u00a0%";
    li.append(label, bar, value);
    return li;
  });
  if (!rows.length) {
    const li = document.createElement("li");
    li.textContent = "No alternatives: set Alternatives to 1 or more and ask again.";
    rows.push(li);
  }
  $("alternatives").replaceChildren(...rows);
}

// The step that chose token i read the sequence up to the token before it: position p - 1,
// where p = len(prompt) + i is the token's own position.
async function loadAttention() {
  const { answer, index } = state.inspected;
  const ids = answer.promptIds.concat(answer.generated.slice(0, index).map((t) => t.id));
  // the first call leaves the layer to the server (the first full-attention layer: a hybrid model's
  // linear-attention layers have no attention weights), whose answer then fills the layer choices
  const layer = $("layer").value === "" ? undefined : Number($("layer").value);
  const heatmap = $("heatmap");
  heatmap.dataset.state = "loading";
  $("attention-note").textContent = "Loading…";
  let attention;
  try {
    attention = await api("v1/npqwen/attention", { tokens: ids, position: ids.length - 1, layer });
  } catch (e) {
    heatmap.dataset.state = "error";
    heatmap.replaceChildren();
    $("attention-note").textContent = "No attention: " + e.message;
    return;
  }
  if (!isInspected(answer, index)) return;   // another token was clicked meanwhile
  if (state.layers === null) fillSelects(attention.attention_layers, attention.num_heads);
  state.attention = attention;
  drawHeatmap();
}

function fillSelects(layers, heads) {   // layers: the ones with attention weights (all of a Qwen3)
  state.layers = layers;
  state.heads = heads;
  const option = (value, text) => {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = text;
    return o;
  };
  $("layer").replaceChildren(...layers.map((l) => option(l, String(l))));
  const headOptions = Array.from({ length: heads }, (_, h) => option(h, String(h)));
  $("head").replaceChildren(option("mean", "mean of heads"), ...headOptions);
}

// One earlier token of a shaded view (attention, saliency): its text, position, hover title and background;
// "strong" (white text) past half the largest share.
function shadedToken(className, text, j, title, background, share) {
  const span = document.createElement("span");
  span.className = className;
  span.textContent = text;
  span.dataset.position = j;
  span.title = title;
  span.style.background = background;
  if (share > 0.5) span.classList.add("strong");
  return span;
}

// The chosen token, after the shaded ones.
function chosenToken(answer, index, title) {
  const next = document.createElement("span");
  next.className = "heat next";
  next.textContent = shown(answer.generated[index].text, answer.generated[index].bytes);
  next.title = title;
  return next;
}

function drawHeatmap() {
  const attention = state.attention;
  const { answer, index } = state.inspected;
  const head = $("head").value;
  const row = head === "mean" ? attention.mean : attention.heads[Number(head)];
  const top = Math.max(...row);
  const heatmap = $("heatmap");
  const spans = attention.tokens.map((text, j) => {
    const span = shadedToken("heat", shown(text, attention.token_bytes[j]), j, `position ${j}: ` +
      `${(100 * row[j]).toFixed(2)} %`, `rgba(37, 99, 235, ${Math.sqrt(row[j] / top).toFixed(3)})`, row[j] / top);
    span.dataset.weight = String(row[j]);
    return span;
  });
  heatmap.replaceChildren(...spans, chosenToken(answer, index, "the token chosen at this step"));
  heatmap.dataset.layer = attention.layer;
  heatmap.dataset.head = head;
  heatmap.dataset.position = attention.position;
  heatmap.dataset.state = "ready";
  const which = head === "mean" ? `the mean of ${attention.num_heads} heads` : `head ${head}`;
  $("attention-note").textContent = `Where position ${attention.position} (the token before the chosen one, ` +
    `outlined) looked when the model chose it: layer ${attention.layer}, ${which}. ` +
    `Shade ∝ √(weight / largest weight, ${(100 * top).toFixed(1)}\u00a0%); hover a token for its weight.`;
}

// Qwen3-MoE: the experts the router of each layer sent the token to (the token itself, at its own
// position p), best first, with their weights. A dense model answers num_experts 0: nothing shown.
async function loadExperts() {
  const { answer, index } = state.inspected;
  const ids = answer.promptIds.concat(answer.generated.slice(0, index + 1).map((t) => t.id));
  const view = $("experts-view");
  let experts;
  try {
    experts = await api("v1/npqwen/experts", { tokens: ids });
  } catch (e) {
    view.hidden = false;
    $("experts").replaceChildren();
    $("experts-note").textContent = "No experts: " + e.message;
    return;
  }
  if (!isInspected(answer, index)) return;   // another token was clicked meanwhile
  view.hidden = experts.num_experts === 0;
  const rows = experts.layers.map((layer) => {
    const li = document.createElement("li");
    li.dataset.layer = layer.layer;
    const name = document.createElement("span");
    name.className = "layer";
    name.textContent = `layer ${layer.layer}`;
    li.append(name);
    if (layer.experts === null) li.append("dense MLP");
    (layer.experts || []).forEach((e, j) => {
      const chip = document.createElement("span");
      chip.className = "expert";
      chip.dataset.expert = e;
      chip.dataset.weight = String(layer.weights[j]);
      chip.textContent = `#${e} ${(100 * layer.weights[j]).toFixed(1)}\u00a0%`;
      li.append(chip);
    });
    return li;
  });
  $("experts").replaceChildren(...rows);
  $("experts-note").textContent = `Where the router sent this token (position ${experts.position}): ` +
    `${experts.num_experts_per_tok} of ${experts.num_experts} experts in each layer, best first, ` +
    `with the weight of each in the layer's output.`;
}

// Saliency: which earlier tokens the chosen token leaned on, as gradient x input of its log-probability
// for each token's embedding (/v1/npqwen/saliency: one backward pass). Warm (orange) for a token that raised
// the chosen token's probability, cool (blue) for one that lowered it; shade ∝ |score| / the largest |score|.
async function loadSaliency() {
  const { answer, index } = state.inspected;
  const ids = answer.promptIds.concat(answer.generated.slice(0, index + 1).map((t) => t.id));
  const view = $("saliency");
  view.dataset.state = "loading";
  let saliency;
  try {
    saliency = await api("v1/npqwen/saliency", { tokens: ids });
  } catch (e) {
    view.dataset.state = "error";
    view.replaceChildren();
    $("saliency-note").textContent = "No saliency: " + e.message;
    return;
  }
  if (!isInspected(answer, index)) return;   // another token was clicked meanwhile
  const top = Math.max(...saliency.scores.map(Math.abs)) || 1;
  const spans = saliency.tokens.map((text, j) => {
    const score = saliency.scores[j];
    const color = score >= 0 ? "234, 88, 12" : "37, 99, 235";
    const span = shadedToken("sal", shown(text, saliency.token_bytes[j]), j, `position ${j}: ` +
      `${score >= 0 ? "+" : ""}${score.toPrecision(3)}`, `rgba(${color}, ${(Math.abs(score) / top).toFixed(3)})`,
      Math.abs(score) / top);
    span.dataset.score = String(score);
    return span;
  });
  view.replaceChildren(...spans, chosenToken(answer, index, "the chosen token"));
  view.dataset.position = saliency.position;
  view.dataset.state = "ready";
  $("saliency-note").textContent = "Gradient × input of the chosen token's log-probability for each earlier " +
    "token's embedding: orange raised it, blue lowered it (shade ∝ |score| / the largest). Hover for the value.";
}

// The logit lens of the chosen token: the probability (a bar) and rank each layer's lens gives it, read
// at the position before it, where it was predicted (/v1/npqwen/layers). The last layer is the model's own.
async function loadLayers() {
  const { answer, index } = state.inspected;
  const ids = answer.promptIds.concat(answer.generated.slice(0, index + 1).map((t) => t.id));
  let lens;
  try {
    lens = await api("v1/npqwen/layers", { tokens: ids });
  } catch (e) {
    $("layers").replaceChildren();
    $("layers-note").textContent = "No layers: " + e.message;
    return;
  }
  if (!isInspected(answer, index)) return;   // another token was clicked meanwhile
  const rows = lens.layers.map((layer) => {
    const li = document.createElement("li");
    li.dataset.layer = layer.layer;
    li.dataset.probability = String(layer.probability);
    li.dataset.rank = String(layer.rank);
    const name = document.createElement("span");
    name.className = "layer";
    name.textContent = `layer ${layer.layer}`;
    const track = document.createElement("span");
    track.className = "track";
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.display = "block";
    bar.style.width = `${(100 * layer.probability).toFixed(1)}%`;
    track.append(bar);
    li.append(name, track, `${(100 * layer.probability).toFixed(2)}\u00a0% \u00b7 rank ${layer.rank + 1}`);
    return li;
  });
  $("layers").replaceChildren(...rows);
  $("layers-note").textContent = "This token under each layer's logit lens (the layer's output through the " +
    "final norm and lm_head, at the position before it): its probability and rank. The last layer is the model's.";
}

// SAE features (npqwen serve --sae): the clicked token's strongest features with their activations and
// labels; clicking one shades every token of the conversation by that feature's activation there.
async function loadFeatures() {
  const { answer, index } = state.inspected;
  const ids = answer.promptIds.concat(answer.generated.map((t) => t.id));
  const body = { tokens: ids, position: answer.promptIds.length + index };
  if ($("sae").value) body.sae = $("sae").value;
  let features;
  try {
    features = await api("v1/npqwen/features", body);
  } catch (e) {
    $("features-view").hidden = false;
    $("features").replaceChildren();
    $("features-note").textContent = "No features: " + e.message;
    return;
  }
  if (!isInspected(answer, index)) return;   // another token was clicked meanwhile
  $("features-view").hidden = features.saes.length === 0;
  if (features.saes.length === 0) return;
  if ($("sae").options.length === 0) {
    $("sae").replaceChildren(...features.saes.map((name) => {
      const o = document.createElement("option");
      o.value = name;
      o.textContent = name;
      return o;
    }));
  }
  state.features = features;
  const rows = features.features.map((f) => {
    const li = document.createElement("li");
    li.dataset.feature = String(f.feature);
    li.dataset.activation = String(f.activation);
    const chip = document.createElement("button");
    chip.type = "button";
    chip.className = "feature";
    chip.textContent = `#${f.feature} ${f.activation.toFixed(3)}`;
    chip.addEventListener("click", () => drawFeatureTokens(f));
    li.append(chip);
    if (f.label) {
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = f.label;
      li.append(label);
    }
    return li;
  });
  $("features").replaceChildren(...rows);
  $("feature-tokens").replaceChildren();
  $("feature-tokens-note").textContent = "";
  $("features-note").textContent = rows.length === 0 ? "No feature fires on this token." :
    `The strongest features of ${features.sae} (${features.kind}, ${features.num_features} features, reading ` +
    `${features.reads}) on this token; click one to see where it fires.`;
}

function drawFeatureTokens(f) {   // each token of the conversation shaded by the feature's activation on it
  const peak = Math.max(...f.activations);
  const spans = state.features.tokens.map((text, p) => {
    const span = document.createElement("span");
    const a = f.activations[p];
    span.className = "heat";
    span.dataset.position = String(p);
    span.dataset.activation = String(a);
    span.textContent = shown(text, state.features.token_bytes[p]);
    span.title = a.toFixed(4);
    if (a > 0) span.style.background = `rgba(30, 120, 200, ${(a / peak).toFixed(3)})`;
    return span;
  });
  $("feature-tokens").replaceChildren(...spans);
  const fires = f.activations.filter((a) => a > 0).length;
  $("feature-tokens-note").textContent = `Feature #${f.feature} fires on ${fires} of the ` +
    `${f.activations.length} tokens (the darker, the stronger; hover for the activation).`;
}

function closeInspector() {
  state.inspected = null;
  state.attention = null;
  $("inspector").hidden = true;
  document.body.classList.remove("inspecting");
  document.querySelectorAll(".tok.selected").forEach((s) => s.classList.remove("selected"));
}

// -- wiring --

function start() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send($("prompt").value);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("new-chat").addEventListener("click", newChat);
  $("settings-toggle").addEventListener("click", () => toggleSettings());
  $("settings").addEventListener("submit", (e) => e.preventDefault());
  $("api-key").addEventListener("input", () => { state.apiKey = $("api-key").value.trim(); });
  $("api-key").addEventListener("change", loadModel);
  $("layer").addEventListener("change", () => { if (state.inspected) loadAttention(); });
  $("head").addEventListener("change", () => { if (state.attention) drawHeatmap(); });
  $("sae").addEventListener("change", () => { if (state.inspected) loadFeatures(); });
  $("inspector-close").addEventListener("click", closeInspector);
  loadModel();
}

start();
