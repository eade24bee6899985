// Batches page: the tenant's batches with live progress, result downloads, cancel, and a form to start one.
import { apiFetch, apiJson } from "./api.js";
import { clearError, h, showError } from "./dom.js";
import { formatCompact, formatDateTime } from "./format.js";
import { requireApiKey } from "./session.js";

const POLL_MS = 2000;
const PAGE = 20;
const ACTIVE = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const BADGE = { completed: "ready", failed: "failed", expired: "failed", cancelled: "failed" };

const table = document.getElementById("batches-table");
const tbody = document.getElementById("batches-body");
const emptyNote = document.getElementById("batches-empty");
const listError = document.getElementById("batches-error");
const listStatus = document.getElementById("batches-status");
const moreButton = document.getElementById("batches-more");
const form = document.getElementById("batch-form");
const fileInput = document.getElementById("batch-file");
const endpointSelect = document.getElementById("batch-endpoint");
const formError = document.getElementById("batch-error");
const submitButton = document.getElementById("batch-submit");

let batches = [];
let hasMore = false;
let pollTimer = null;

function statusBadge(status) {
  const label = status.replace("_", " ");
  return h("span", { class: `badge badge-${BADGE[status] ?? "validating"}`, "data-status": status }, label);
}

function progressCell(batch) {
  const { total, completed, failed } = batch.request_counts;
  const done = completed + failed;
  const text = total ? `${done} / ${total}${failed ? ` (${failed} failed)` : ""}` : "—";
  return h("td", { "data-label": "Progress" },
    total ? h("progress", { max: String(total), value: String(done), "aria-label": `${batch.id} progress` }) : null,
    h("span", { class: "small muted" }, text));
}

async function download(fileId, name) {
  try {
    const response = await apiFetch(`/v1/files/${encodeURIComponent(fileId)}/content`);
    const url = URL.createObjectURL(await response.blob());
    const link = h("a", { href: url, download: name });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  } catch (err) {
    showError(listError, `Download failed: ${err.message}`);
  }
}

async function cancel(batch) {
  try {
    const updated = await apiJson(`/v1/batches/${encodeURIComponent(batch.id)}/cancel`, { method: "POST" });
    batches = batches.map((b) => (b.id === updated.id ? updated : b));
    render();
    schedule();
  } catch (err) {
    showError(listError, `Cancel failed: ${err.message}`);
  }
}

function actions(batch) {
  const buttons = [];
  if (batch.output_file_id) {
    buttons.push(h("button", { type: "button", class: "btn btn-quiet btn-small", "data-action": "output",
      onclick: () => download(batch.output_file_id, `${batch.id}_output.jsonl`) }, "Results"));
  }
  if (batch.error_file_id) {
    buttons.push(h("button", { type: "button", class: "btn btn-quiet btn-small", "data-action": "errors",
      onclick: () => download(batch.error_file_id, `${batch.id}_errors.jsonl`) }, "Errors"));
  }
  if (batch.status === "validating" || batch.status === "in_progress") {
    buttons.push(h("button", { type: "button", class: "btn btn-danger-quiet btn-small", "data-action": "cancel",
      onclick: () => cancel(batch) }, "Cancel"));
  }
  return h("td", { class: "cell-actions" }, buttons);
}

function batchRow(batch) {
  const reasons = (batch.errors?.data ?? []).map((e) => `line ${e.line ?? "-"}: ${e.message}`);
  const usage = batch.usage ?? { input_tokens: 0, output_tokens: 0 };
  return h("tr", { "data-batch": batch.id, "data-status": batch.status },
    h("td", { class: "cell-name", "data-label": "Batch" },
      h("span", { class: "adapter-name" }, batch.id),
      h("span", { class: "adapter-description" }, batch.endpoint),
      reasons.length ? h("span", { class: "failure-reason", role: "note" }, reasons.slice(0, 3).join("; ")) : null),
    h("td", { "data-label": "Status" }, statusBadge(batch.status)),
    progressCell(batch),
    h("td", { "data-label": "Tokens" }, `${formatCompact(usage.input_tokens)} in / ${formatCompact(usage.output_tokens)} out`),
    h("td", { "data-label": "Created" }, formatDateTime(batch.created_at)),
    actions(batch));
}

function render() {
  tbody.replaceChildren(...batches.map(batchRow));
  table.hidden = batches.length === 0;
  emptyNote.hidden = batches.length !== 0;
  moreButton.hidden = !hasMore;
}

function schedule() {
  clearTimeout(pollTimer);
  if (batches.some((b) => ACTIVE.has(b.status))) pollTimer = setTimeout(refresh, POLL_MS);
}

async function refresh() {
  try {
    const page = await apiJson("/v1/batches", { params: { limit: String(Math.max(PAGE, batches.length)) } });
    batches = page.data;
    hasMore = page.has_more;
    clearError(listError);
    listStatus.textContent = `Updated ${new Date().toLocaleTimeString()}`;
    render();
    schedule();
  } catch (err) {
    showError(listError, err.message);
    pollTimer = setTimeout(refresh, POLL_MS * 4);
  }
}

async function loadMore() {
  const last = batches[batches.length - 1];
  const page = await apiJson("/v1/batches", { params: { limit: String(PAGE), after: last.id } });
  batches = batches.concat(page.data);
  hasMore = page.has_more;
  render();
}

async function startBatch(event) {
  event.preventDefault();
  clearError(formError);
  const file = fileInput.files[0];
  if (!file) {
    showError(formError, "Choose a .jsonl file of requests.");
    return;
  }
  submitButton.disabled = true;
  try {
    const body = new FormData();
    body.append("purpose", "batch");
    body.append("file", file, file.name);
    const uploaded = await apiJson("/v1/files", { method: "POST", body });
    const batch = await apiJson("/v1/batches", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ input_file_id: uploaded.id, endpoint: endpointSelect.value, completion_window: "24h" }),
    });
    batches = [batch, ...batches.filter((b) => b.id !== batch.id)];
    form.reset();
    render();
    schedule();
  } catch (err) {
    showError(formError, err.message);
  } finally {
    submitButton.disabled = false;
  }
}

form.addEventListener("submit", startBatch);
moreButton.addEventListener("click", () => loadMore().catch((err) => showError(listError, err.message)));
if (requireApiKey()) refresh();
