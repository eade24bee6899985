// Chat with the base model or a ready adapter; the answer streams token by token.
import { apiFetch, apiJson } from "./api.js";
import { clearError, h, showError } from "./dom.js";
import { requireApiKey } from "./session.js";
import { chatChunks } from "./sse.js";

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
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify({
        model: modelSelect.value,
        messages,
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: Math.round(numberOr(maxTokensInput, 256)),
        temperature: numberOr(temperatureInput, 0.7),
      }),
      signal: controller.signal,
    });
    for await (const chunk of chatChunks(response.body, controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta ?? {};
      if (delta.reasoning_content) {
        if (!reasoningEl) {
          reasoningEl = h("details", { class: "reasoning", open: true },
            h("summary", {}, "Thinking"), h("div", { class: "reasoning-text" }));
          item.insertBefore(reasoningEl, content);
        }
        reasoningEl.lastChild.append(delta.reasoning_content);
      }
      if (delta.content) {
        firstTokenAt ??= performance.now();
        answer += delta.content;
        content.textContent = answer;
        numChunks += 1;
      }
    }
    messages.push({ role: "assistant", content: answer });
    const seconds = (performance.now() - started) / 1000;
    const parts = [`${numChunks} chunks in ${seconds.toFixed(1)} s`];
    if (firstTokenAt) parts.push(`first token after ${((firstTokenAt - started) / 1000).toFixed(2)} s`);
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    statsEl.textContent = parts.join(" · ");
  } catch (err) {
    if (err.name === "AbortError") {
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
  transcript.replaceChildren();
  emptyNote.hidden = false;
  statsEl.textContent = "";
  clearError(errorEl);
});

if (requireApiKey()) loadModels();
