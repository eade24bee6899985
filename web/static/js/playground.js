// Chat with the base model or a ready adapter through the Responses API; the answer streams token by token.
// Each turn sends only the new message and names the previous response: the server keeps the conversation
// (and its KV cache pinned). After a stopped turn or a change of model, the whole conversation is sent once
// and a new chain starts from there.
import { apiFetch, apiJson } from "./api.js";
import { clearError, h, showError } from "./dom.js";
import { requireApiKey } from "./session.js";
import { responseEvents } from "./sse.js";

const modelSelect = document.getElementById("model-select");
const maxTokensInput = document.getElementById("max-tokens");
const temperatureInput = document.getElementById("temperature");
const transcript = document.getElementById("transcript");
const emptyNote = document.getElementById("transcript-empty");
const form = document.getElementById("chat-form");
const input = document.getElementById("chat-input");
const sendButton = document.getElementById("chat-send");
const stopButton = document.getElementById("chat-stop");
const clearButton = document.getElementById("chat-clear");
const errorEl = document.getElementById("chat-error");
const statsEl = document.getElementById("chat-stats");

const messages = [];
let controller = null;
let chain = null;  // { id, model } of the last stored response the next turn continues

async function loadModels() {
  try {
    const { data } = await apiJson("/v1/models");
    // the base model(s) first, then adapters (their `parent` is the base)
    const bases = data.filter((m) => !m.parent);
    const adapters = data.filter((m) => m.parent);
    modelSelect.replaceChildren(
      h("optgroup", { label: "Base model" }, bases.map((m) => h("option", { value: m.id }, m.id))),
      adapters.length
        ? h("optgroup", { label: "Your adapters" }, adapters.map((m) => h("option", { value: m.id }, m.id)))
        : null,
    );
    const wanted = new URLSearchParams(window.location.search).get("model");
    if (wanted && data.some((m) => m.id === wanted)) modelSelect.value = wanted;
    modelSelect.disabled = false;
  } catch (err) {
    modelSelect.replaceChildren(h("option", {}, "Unavailable"));
    showError(errorEl, `Cannot list models: ${err.message}`);
  }
}

function addTurn(role, text = "") {
  emptyNote.hidden = true;
  const content = h("div", { class: "turn-content" }, text);
  const item = h("li", { class: `turn turn-${role}` },
    h("span", { class: "turn-role" }, role === "user" ? "You" : modelSelect.value), content);
  transcript.append(item);
  return { item, content };
}

function setStreaming(on) {
  sendButton.disabled = on;
  modelSelect.disabled = on;
  stopButton.hidden = !on;
  clearButton.disabled = on;
}

function numberOr(inputEl, fallback) {
  const value = Number(inputEl.value);
  return inputEl.value !== "" && Number.isFinite(value) ? value : fallback;
}

async function send(text) {
  clearError(errorEl);
  statsEl.textContent = "";
  messages.push({ role: "user", content: text });
  const userTurn = addTurn("user", text);
  const { item, content } = addTurn("assistant");
  item.classList.add("streaming");
  let reasoningEl = null;
  let answer = "";
  let numChunks = 0;
  let usage = null;
  const started = performance.now();
  let firstTokenAt = null;
  controller = new AbortController();
  setStreaming(true);
  try {
    const model = modelSelect.value;
    const continues = chain && chain.model === model;
    const response = await apiFetch("/v1/responses", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify({
        model,
        input: continues ? text : messages,
        previous_response_id: continues ? chain.id : undefined,
        stream: true,
        max_output_tokens: Math.round(numberOr(maxTokensInput, 256)),
        temperature: numberOr(temperatureInput, 0.7),
      }),
      signal: controller.signal,
    });
    let finished = null;
    for await (const event of responseEvents(response.body, controller.signal)) {
      if (event.type === "response.reasoning_text.delta") {
        if (!reasoningEl) {
          reasoningEl = h("details", { class: "reasoning", open: true },
            h("summary", {}, "Thinking"), h("div", { class: "reasoning-text" }));
          item.insertBefore(reasoningEl, content);
        }
        reasoningEl.lastChild.append(event.delta);
      } else if (event.type === "response.output_text.delta") {
        firstTokenAt ??= performance.now();
        answer += event.delta;
        content.textContent = answer;
        numChunks += 1;
      } else if (event.type === "response.completed" || event.type === "response.incomplete") {
        finished = event.response;
      } else if (event.type === "response.failed") {
        throw new Error(event.response?.error?.message ?? "The response failed");
      }
    }
    if (!finished) throw new Error("The stream ended before the response was complete");
    usage = finished.usage;
    chain = { id: finished.id, model };
    messages.push({ role: "assistant", content: answer });
    const seconds = (performance.now() - started) / 1000;
    const parts = [`${numChunks} chunks in ${seconds.toFixed(1)} s`];
    if (firstTokenAt) parts.push(`first token after ${((firstTokenAt - started) / 1000).toFixed(2)} s`);
    if (usage) {
      const cached = usage.input_tokens_details?.cached_tokens ?? 0;
      parts.push(`${usage.input_tokens} prompt (${cached} cached) + ${usage.output_tokens} completion tokens`);
    }
    statsEl.textContent = parts.join(" · ");
  } catch (err) {
    if (err.name === "AbortError") {
      // a stopped response is not stored: the next turn sends the conversation, partial answer included
      chain = null;
      messages.push({ role: "assistant", content: answer });
      statsEl.textContent = "Stopped.";
    } else {
      // the turn failed: take it back out so the conversation stays consistent
      messages.pop();
      userTurn.item.remove();
      item.remove();
      input.value = text;
      emptyNote.hidden = messages.length > 0;
      showError(errorEl, err.message);
    }
  } finally {
    item.classList.remove("streaming");
    item.classList.add("done");
    controller = null;
    setStreaming(false);
    input.focus();
  }
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (!text || controller || modelSelect.disabled) return;
  input.value = "";
  send(text);
});

input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    form.requestSubmit();
  }
});

stopButton.addEventListener("click", () => controller?.abort());

clearButton.addEventListener("click", () => {
  messages.length = 0;
  chain = null;
  transcript.replaceChildren();
  emptyNote.hidden = false;
  statsEl.textContent = "";
  clearError(errorEl);
});

if (requireApiKey()) loadModels();
