// The specdec playground (docs/server.md, "The playground"): a chat over the server's own
// /v1/chat/completions, streamed with include_token_sources, each token coloured by how it
// came. Plain JavaScript, no build step and no external URL: it works offline.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "specdec-playground-api-key";  // sessionStorage: gone with the tab
const state = { model: null, messages: [], busy: false };

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

// The served model, its method and k (GET /v1/models): the picker offers 0..k.
async function loadServer() {
  const info = $("server-info");
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const card = (await response.json()).data[0];
    const spec = card.speculative;
    state.model = card.id;
    $("method").textContent = spec.method;
    const picker = $("num-speculative-tokens");
    picker.replaceChildren();
    for (let k = 0; k <= spec.num_speculative_tokens; k++) {
      picker.append(new Option(k === 0 ? "0 (plain decoding)" : String(k), String(k), false,
                               k === spec.num_speculative_tokens));
    }
    info.textContent = `${card.id}: method ${spec.method}, up to ${spec.num_speculative_tokens} drafts per ` +
      `step, a context of ${card.max_model_len} tokens`;
    info.dataset.state = "ready";
  } catch (error) {
    info.textContent = `Cannot read /v1/models: ${error.message}`;
    info.dataset.state = "error";
  }
}

// The server-sent events of a streamed response, parsed: each data line's JSON, up to [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// Live figures from the token sources: a speculative step is a run of accepted drafts ended by
// the target's own (bonus) token, so each run says how many drafts that step accepted.
class Stats {
  constructor() {
    this.started = performance.now();
    this.firstAt = null;
    this.lastAt = null;
    this.tokens = new Set();  // indices: a token cut across chunks counts once
    this.drafted = 0;
    this.run = 0;             // accepted drafts of the step in progress
    this.steps = 0;           // speculative steps (steps with drafts)
    this.acceptedAt = [];     // steps that accepted a draft at position i (from 0)
    this.usage = null;
  }

  add(entry) {
    if (this.tokens.has(entry.index)) return;
    this.tokens.add(entry.index);
    this.lastAt = performance.now();
    if (this.firstAt === null) this.firstAt = this.lastAt;
    if (entry.source === "draft") {
      this.run += 1;
      this.drafted += 1;
    } else {
      if (entry.source === "bonus") this.endStep();
      this.run = 0;
    }
  }

  endStep() {
    this.steps += 1;
    for (let i = 0; i < this.run; i++) this.acceptedAt[i] = (this.acceptedAt[i] || 0) + 1;
  }

  finish() {  // a request cut right after accepted drafts (an EOS or max_tokens among them)
    if (this.run > 0) this.endStep();
    this.run = 0;
  }

  // [accepted, steps] by draft position: usage.speculative's once the request has finished.
  acceptance() {
    const spec = this.usage && this.usage.speculative;
    if (spec) return spec.accepted_per_position.map((n) => [n, spec.num_drafts]);
    return this.acceptedAt.map((n) => [n || 0, this.steps]);
  }
}

function showStats(stats) {
  const count = stats.usage ? stats.usage.completion_tokens : stats.tokens.size;
  $("stat-tokens").textContent = String(count);
  const decoding = stats.firstAt !== null && stats.lastAt > stats.firstAt;
  $("stat-speed").textContent = decoding
    ? ((stats.tokens.size - 1) / ((stats.lastAt - stats.firstAt) / 1000)).toFixed(1) : "–";
  $("stat-ttft").textContent = stats.firstAt === null ? "–" : `${Math.round(stats.firstAt - stats.started)} ms`;
  $("stat-drafted").textContent = stats.tokens.size
    ? `${Math.round((100 * stats.drafted) / stats.tokens.size)} %` : "–";
  const rows = stats.acceptance().map(([accepted, steps], i) => {
    const share = steps ? accepted / steps : 0;
    const row = document.createElement("tr");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.round(share * 12)}rem`;
    for (const cell of [`position ${i + 1}`, bar, `${Math.round(100 * share)} %`, `${accepted}/${steps}`]) {
      const td = document.createElement("td");
      td.append(cell);
      row.append(td);
    }
    return row;
  });
  $("acceptance-table").tBodies[0].replaceChildren(...rows);
}

function addMessage(role, text) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  message.textContent = text;
  $("conversation").append(message);
  return message;
}

// One token (or the part of it in this chunk) as a span coloured by its source.
function appendToken(answer, entry) {
  if (!entry.text) return;  // an end-of-sequence token, or a byte the next token completes
  const last = answer.lastElementChild;
  if (last && last.dataset.index === String(entry.index)) {  // the rest of a token cut across chunks
    last.textContent += entry.text;
    return;
  }
  const span = document.createElement("span");
  span.className = `tok tok-${entry.source}`;
  span.dataset.index = String(entry.index);
  span.title = `token ${entry.index}: ${entry.source}`;
  span.textContent = entry.text;
  answer.append(span);
}

function requestBody() {
  const body = {
    messages: state.messages,
    stream: true,
    stream_options: { include_usage: true },
    include_token_sources: true,
    temperature: Number($("temperature").value || 0),
    speculative: { num_speculative_tokens: Number($("num-speculative-tokens").value || 0) },
  };
  if (state.model) body.model = state.model;
  if ($("max-tokens").value) body.max_tokens = Number($("max-tokens").value);
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.busy) return;
  state.busy = true;
  $("send").disabled = true;
  addMessage("user", text);
  state.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  const answer = addMessage("assistant", "");
  answer.dataset.state = "streaming";
  const stats = new Stats();
  let content = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders(), body: JSON.stringify(requestBody()),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) stats.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        content += piece;
        if (choice.token_sources) {
          for (const entry of choice.token_sources) {
            appendToken(answer, entry);
            stats.add(entry);
          }
        } else if (piece) {
          answer.append(piece);
        }
      }
      showStats(stats);
    }
    stats.finish();
    showStats(stats);
    state.messages.push({ role: "assistant", content });
    answer.dataset.state = "done";
  } catch (error) {
    state.messages.pop();  // the question goes again with the next one
    answer.classList.add("error");
    answer.append(document.createTextNode(`Error: ${error.message}`));
    answer.dataset.state = "error";
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

function start() {
  $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadServer();
  });
  $("chat").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat").requestSubmit();
    }
  });
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("conversation").replaceChildren();
  });
  loadServer();
}

start();
