// Requests section of the usage page: the per-request log (/v1/usage/requests), newest first,
// 25 rows at a time with "Load more" following next_cursor; the filter box takes a request id
// or a session id.
import { namesFor } from "./adapter_names.js";
import { ApiError, apiJson } from "./api.js";
import { h } from "./dom.js";
import { formatCost, formatInt } from "./format.js";

const PAGE_SIZE = 25;
const TOKEN_CELLS = [
  ["input_tokens", "Input"], ["cached_input_tokens", "Cached"], ["output_tokens", "Output"], ["thinking_tokens", "Thinking"],
];

// The adapters page's badges: green for a request that ran its course, red for one that failed.
const STATUS_BADGE = { completed: "badge-ready", stopped: "badge-ready", length: "badge-validating", failed: "badge-failed" };

const filterForm = document.getElementById("requests-filter");
const filterInput = document.getElementById("requests-query");
const clearButton = document.getElementById("requests-clear");
const table = document.getElementById("requests-table");
const tbody = document.getElementById("requests-body");
const summary = document.getElementById("requests-summary");
const emptyNote = document.getElementById("requests-empty");
const moreButton = document.getElementById("requests-more");
const errorEl = document.getElementById("requests-error");

let range = null;
let params = {};
let nextCursor = null;

// Seconds matter here: an agent's turns are often within the same minute.
const timeLabel = (iso) => new Date(iso).toLocaleString(undefined, {
  month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit",
});

// Key under request and adapter under model keep the table within the page; the exact
// time and cost stay in the cells' titles, as the API and the CSV give them.
function requestRow(row, names) {
  const sub = (text) => h("span", { class: "sub" }, text);
  return h("tr", { dataset: { requestId: row.request_id } },
    h("td", { "data-label": "Time", title: row.created_at }, timeLabel(row.created_at)),
    h("td", { "data-label": "Request", class: "mono" }, row.request_id, sub(row.api_key_id ?? "no key")),
    h("td", { "data-label": "Model", class: "cell-model" }, row.model, row.adapter_id ? sub(names.get(row.adapter_id) ?? row.adapter_id) : null),
    h("td", { "data-label": "Status" }, h("span", { class: `badge ${STATUS_BADGE[row.status] ?? ""}` }, row.status)),
    ...TOKEN_CELLS.map(([key, name]) => h("td", { class: "num", "data-label": name }, formatInt(row[key]))),
    h("td", { class: "num", "data-label": "Cost", title: `$${row.cost_usd}` }, formatCost(row.cost_usd)),
  );
}

async function show(rows, { append, hasMore, totals }) {
  const names = await namesFor(rows.map((row) => row.adapter_id));
  const built = rows.map((row) => requestRow(row, names));
  if (append) tbody.append(...built);
  else tbody.replaceChildren(...built);
  const shown = tbody.children.length;
  table.hidden = shown === 0;
  emptyNote.hidden = shown !== 0;
  moreButton.hidden = !hasMore;
  summary.textContent = totals
    ? `${formatInt(shown)} of ${formatInt(totals.requests)} requests · ${formatInt(totals.total_tokens)} tokens · ${formatCost(totals.cost_usd)}`
    : "";
}

async function loadPage(append) {
  errorEl.hidden = true;
  moreButton.disabled = true;
  try {
    const query = { ...range, ...params, limit: PAGE_SIZE, ...(append && nextCursor ? { cursor: nextCursor } : {}) };
    const page = await apiJson("/v1/usage/requests", { params: query });
    nextCursor = page.next_cursor;
    await show(page.data, { append, hasMore: page.has_more, totals: page.totals });
  } catch (err) {
    errorEl.textContent = `Cannot load requests: ${err.message}`;
    errorEl.hidden = false;
  } finally {
    moreButton.disabled = false;
  }
}

// Request ids (x-request-id) start with "req_" and are looked up directly, whatever their day;
// anything else is taken as a session id: that session's requests in the range, with their total.
async function applyFilter(value) {
  clearButton.hidden = !value;
  params = {};
  nextCursor = null;
  if (value.startsWith("req_")) {
    try {
      await show([await apiJson(`/v1/usage/requests/${encodeURIComponent(value)}`)], { append: false, hasMore: false, totals: null });
    } catch (err) {
      if (!(err instanceof ApiError) || err.status !== 404) throw err;
      await show([], { append: false, hasMore: false, totals: null });
    }
    return;
  }
  if (value) params = { session_id: value };
  await loadPage(false);
}

export function loadRequests(newRange) {
  range = newRange;
  return applyFilter(filterInput.value.trim()).catch((err) => {
    errorEl.textContent = `Cannot load requests: ${err.message}`;
    errorEl.hidden = false;
  });
}

filterForm.addEventListener("submit", (event) => {
  event.preventDefault();
  if (range) loadRequests(range);
});
clearButton.addEventListener("click", () => {
  filterInput.value = "";
  if (range) loadRequests(range);
});
moreButton.addEventListener("click", () => loadPage(true));
